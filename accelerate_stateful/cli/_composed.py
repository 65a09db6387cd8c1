"""Which source and which document a composable source's item ``k`` is, from saved positions alone (``samples``).

A ``Mixture``'s sample ``k`` comes from the source a hash of ``(seed, epoch, k)`` picks under the schedule
in effect at ``k`` (``sources.schedule.Picker``, the very function its cursor draws with), and it is that
source's next item: the number of earlier samples drawn from the same source. A saved position anchors
the count: at its ``next`` it records, per source, the samples ``drawn``, so item ``k < next`` is the
source's item ``drawn - (samples of that source in [k, next))``, found in one sweep over ``[k, next)``
with no source read. A map-style source's item is its dataset index (after ``restarts`` the source was
read again from its start, every ``len`` items: the position says when); a stateful iterable's is the
number of its items before it in its own order this epoch; an inner mixture is named the same way,
from its own position in the share's.

A ``Shuffled`` buffer's item ``k`` is the source's item it handed out as its ``k``-th, replayed from its
position (``_shuffled``), then named from the source's position after the buffer's last read.

What the positions cannot tell is said, never guessed (``Unknown``): which documents a ``Packed`` row is
cut from depends on their lengths, which items a ``Filtered`` keeps on its predicate (the outermost source's
marks tell both for its own steps: ``_packed``, ``_filtered``), and a ``Shuffled``
buffer's draws on a seed a position written before it was recorded lacks. A mixture position written
before mixtures recorded their seed cannot name any source.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ..sources._mixture_draw import GOLDEN
from ..sources.schedule import Picker
from ._read import NotAnswerable
from ._shuffled import handed_out, is_shuffled

# The package's other composable sources, told by the keys of their positions, and why their items
# cannot be named from a position.
_OPAQUE = (
    ({"source", "carry"}, "Packed", "which documents a packed row is cut from depends on the documents' lengths, "
                                    "which the checkpoint does not record"),
    ({"source", "carry", "seq_len"}, "Packed", "which documents a packed row is cut from depends on the "
                                               "documents' lengths, which the checkpoint does not record"),
    ({"source", "carry", "seq_len", "documents", "offset"}, "Packed",
     "which documents a packed row below another source is cut from depends on the documents' lengths, which "
     "the checkpoint records only for the outermost source's steps"),
    ({"source", "kept", "dropped"}, "Filtered",
     "which items a Filtered keeps depends on its predicate applied to the data, and the checkpoint records "
     "what a filter drew for each step only where it is the loader's outermost source, or the source of an "
     "outermost Packed in a checkpoint written since packers note their filter's draws"),
    ({"from", "from_read", "read", "slots", "draws", "ended"}, "Shuffled",
     "a Shuffled buffer's draws depend on its seed, which its saved position does not record"),
    ({"from", "from_read", "read", "rows", "rng", "given", "final"}, "exact_shuffle",
     "an exact_shuffle stream's order is drawn by datasets from its shards, which the checkpoint does not "
     "record"),
)
_MIXTURE_KEYS = {"next", "schedule", "sources", "drawn", "delivered", "restarts"}


# Above this many samples to sweep, importing numpy (about 0.1 s) and drawing them with it is faster than
# drawing them one by one in Python (a few µs each).
PYTHON_SWEEP = 20_000


class Unknown(str):
    """Why an item's document cannot be named from the checkpoint (in the user's terms)."""


def is_packed(position: Any) -> bool:
    """A ``Packed`` position that counts its documents (written from this release on): as the outermost source,
    its steps are named from the marks of the blocks' ends (``_packed``)."""
    return isinstance(position, Mapping) and {"source", "carry", "documents", "offset"} <= set(position)


def is_filtered(position: Any) -> bool:
    """A ``Filtered`` position: as the outermost source, its steps are named from the marks of the blocks' ends
    (``_filtered``)."""
    return isinstance(position, Mapping) and set(position) == {"source", "kept", "dropped"}


def is_mixture(position: Any) -> bool:
    return isinstance(position, Mapping) and _MIXTURE_KEYS <= set(position)


def opaque_kind(position: Any) -> Optional[tuple[str, str]]:
    """``(kind, why)`` for a position of the package's sources whose items cannot be named, else ``None``."""
    if isinstance(position, Mapping):
        for keys, kind, why in _OPAQUE:
            if set(position) == keys:
                return kind, why
    return None


def is_named(position: Any) -> bool:
    """Whether ``samples`` names the items of a source with this position: a mixture's, or a buffer's over one."""
    return is_mixture(position) or is_shuffled(position)


def name_items(anchors: list, ks: list[int], epoch: int) -> list[dict]:
    """For each global item index of ``ks`` (each below some anchor's count read), ``{"source", "document"}``
    (``document``: the item of that source; ``None`` with ``"unknown"`` saying why, where it cannot be told;
    ``source``: ``None`` for the items of a buffer over a single dataset).

    ``anchors`` are the outermost source's saved positions (one per worker share, mixtures or buffers): every
    share reads the whole sequence, so any share that read past ``k`` anchors it; the nearest is used.
    """
    if not ks:
        return []
    anchor = _nearest(anchors, max(ks))
    if is_shuffled(anchor):
        return _source_items(anchor["to"], None, handed_out(anchor, ks, epoch), epoch)
    names, documents = _sweep(anchor, ks, epoch)
    found: list[dict] = [{} for _ in ks]
    for name in set(names):
        where = [i for i, n in enumerate(names) if n == name]
        inner = _child_items(anchor, name, [documents[i] for i in where], epoch)
        for i, item in zip(where, inner):
            found[i] = item
    return found


def _nearest(anchors: list, k: int) -> Mapping[str, Any]:
    """The position with the smallest ``next`` above ``k``: the shortest sweep back to ``k``."""
    after = [a for a in anchors if a is not None and _count(a) > k]
    if not after:  # a step is asked only where every share read past it: a damaged state otherwise
        raise NotAnswerable(f"no saved worker share of the stream has read its sample {k}; the checkpoint's "
                            "positions disagree with its batch counts, so it cannot say which source that was")
    return min(after, key=_count)


def _count(position: Mapping[str, Any]) -> int:
    """The items a mixture (its ``next``) or a buffer (its draws) has handed out."""
    return position["draws"] if is_shuffled(position) else position["next"]


def _sweep(anchor: Mapping[str, Any], ks: list[int], epoch: int) -> tuple[list[str], list[int]]:
    """For each ``k`` in ``ks``: its source, and how many samples of that source were drawn before it."""
    if "seed" not in anchor:
        raise NotAnswerable(
            "this checkpoint was written before a Mixture recorded its seed in its position, and which source a "
            "sample came from is a hash of that seed; checkpoints saved from this release on name each sample's "
            "source and document"
        )
    pick = Picker(anchor["seed"], epoch, anchor["schedule"])
    first, stop = min(ks), anchor["next"]
    names = sorted(anchor["drawn"])
    picked = (_picked_numpy if stop - first > PYTHON_SWEEP else _picked)(pick, names, first, stop)
    counts = [0] * len(names)
    at, i = {}, stop - first
    for k in sorted(set(ks), reverse=True):  # back from the anchor: each source's samples in [k, stop)
        i, counts = k - first, _counted_back(picked, i, k - first, counts)
        name = names[picked[k - first]]
        at[k] = (name, anchor["drawn"][name] - counts[names.index(name)])
    return [at[k][0] for k in ks], [at[k][1] for k in ks]


def _picked(pick: Picker, names: list[str], first: int, stop: int) -> list[int]:
    """The source (its number in ``names``) of each sample in ``[first, stop)``."""
    number = {name: i for i, name in enumerate(names)}
    return [number[pick(k)] for k in range(first, stop)]


def _picked_numpy(pick: Picker, names: list[str], first: int, stop: int) -> Any:
    """:func:`_picked` with numpy, bit for bit (SplitMix64 wraps as uint64 arithmetic does), a table's span at a
    time."""
    import numpy as np

    found = np.empty(stop - first, dtype=np.int64)
    k = first
    while k < stop:
        table = pick.table(k)
        end = int(min(pick.until, stop))
        ks = np.arange(k, end, dtype=np.uint64)
        with np.errstate(over="ignore"):
            z = np.uint64(pick.key) + ks * np.uint64(GOLDEN) + np.uint64(GOLDEN)
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            z = z ^ (z >> np.uint64(31))
        u = (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
        column = np.searchsorted(np.array(table.cumulative), u, side="right")
        found[k - first:end - first] = np.array([names.index(n) for n in table.names])[column]
        k = end
    return found


def _counted_back(picked: Any, start: int, stop: int, counts: list[int]) -> list[int]:
    """``counts`` (per source, samples in ``[start, end)``) extended back to ``[stop, end)``."""
    if start <= stop:
        return counts
    part = picked[stop:start]
    if hasattr(part, "dtype"):
        import numpy as np

        more = np.bincount(part, minlength=len(counts))
        return [c + int(m) for c, m in zip(counts, more)]
    return [c + part.count(i) for i, c in enumerate(counts)]


def _child_items(anchor: Mapping[str, Any], name: str, items: list[int], epoch: int) -> list[dict]:
    """Items ``items`` of the mixture's source ``name``, named from the anchor's position of that source."""
    position, restarts = anchor["sources"][name], anchor["restarts"][name]
    drawn = anchor["drawn"][name]
    if position is None or (isinstance(position, int) and not isinstance(position, bool)):
        return [{"source": name, "document": _index(j, drawn, position or 0, restarts)} for j in items]
    if restarts and opaque_kind(position) is None:
        kind = "an inner Mixture's" if is_mixture(position) else "a Shuffled's" if is_shuffled(position) else \
            "a stream's"
        return [_unknown(name, j, f"it was read again from its start, and {kind} length is not recorded")
                for j in items]
    return _source_items(position, name, items, epoch)


def _source_items(position: Any, name: Any, items: list[int], epoch: int) -> list[dict]:
    """Items ``items`` of a source read once from its start this epoch, named from its ``position`` (after them):
    ``name`` is the source's in the mixture above it (``None``: no mixture above)."""
    if position is None or (isinstance(position, int) and not isinstance(position, bool)):
        return [{"source": name, "document": j} for j in items]  # a map-style dataset: its index
    if is_named(position):
        inner = name_items([position], items, epoch)
        return [dict(item, source=_joined(name, item["source"])) for item in inner]
    opaque = opaque_kind(position)
    if opaque is not None:
        kind, why = opaque
        return [_unknown(name, j, f"it is a {kind}: {why}") for j in items]
    return [{"source": name, "document": j} for j in items]  # a stateful iterable: its j-th item this epoch


def _joined(outer: Any, inner: Any) -> Any:
    """A source's name below another's (``web/news``); either may be ``None`` (a buffer over one dataset)."""
    return f"{outer}/{inner}" if outer is not None and inner is not None else inner if outer is None else outer


def _index(j: int, drawn: int, position: int, restarts: int) -> int:
    """The dataset index of a map-style source's ``j``-th drawn item, its anchor having drawn ``drawn`` items
    and standing at index ``position`` after ``restarts`` reads from its start (each ``len`` items long)."""
    last_start = drawn - position  # the drawn item that was index 0 of the latest read
    if j >= last_start:
        return j - last_start
    return j % (last_start // restarts)


def _unknown(name: Any, j: int, why: str) -> dict:
    whose = "" if name is None else f"source '{name}': "
    return {"source": name, "document": None, "item": j,
            "unknown": Unknown(f"{whose}its item {j} this epoch is known, not which document: {why}")}
