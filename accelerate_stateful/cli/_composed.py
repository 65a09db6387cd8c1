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

What the positions cannot tell is said, never guessed (``Unknown``): which documents a ``Packed`` row is
cut from depends on their lengths, which items a ``Filtered`` keeps on its predicate, and a ``Shuffled``
buffer's draws on a seed its position does not record. A mixture position written before mixtures
recorded their seed cannot name any source.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ..sources.schedule import Picker
from ._read import NotAnswerable

# The package's other composable sources, told by the keys of their positions, and why their items
# cannot be named from a position.
_OPAQUE = (
    ({"source", "carry"}, "Packed", "which documents a packed row is cut from depends on the documents' lengths, "
                                    "which the checkpoint does not record"),
    ({"source", "carry", "seq_len"}, "Packed", "which documents a packed row is cut from depends on the "
                                               "documents' lengths, which the checkpoint does not record"),
    ({"source", "kept", "dropped"}, "Filtered", "which items a Filtered keeps depends on its predicate applied "
                                                "to the data, which the checkpoint does not record"),
    ({"from", "from_read", "read", "slots", "draws", "ended"}, "Shuffled",
     "a Shuffled buffer's draws depend on its seed, which its saved position does not record"),
    ({"from", "from_read", "read", "rows", "rng", "given", "final"}, "exact_shuffle",
     "an exact_shuffle stream's order is drawn by datasets from its shards, which the checkpoint does not "
     "record"),
)
_MIXTURE_KEYS = {"next", "schedule", "sources", "drawn", "delivered", "restarts"}


class Unknown(str):
    """Why an item's document cannot be named from the checkpoint (in the user's terms)."""


def is_mixture(position: Any) -> bool:
    return isinstance(position, Mapping) and _MIXTURE_KEYS <= set(position)


def opaque_kind(position: Any) -> Optional[tuple[str, str]]:
    """``(kind, why)`` for a position of the package's sources whose items cannot be named, else ``None``."""
    if isinstance(position, Mapping):
        for keys, kind, why in _OPAQUE:
            if set(position) == keys:
                return kind, why
    return None


def name_items(anchors: list, ks: list[int], epoch: int) -> list[dict]:
    """For each global item index of ``ks`` (each below some anchor's ``next``), ``{"source", "document"}``
    (``document``: the item of that source; ``None`` with ``"unknown"`` saying why, where it cannot be told).

    ``anchors`` are the outermost mixture's saved positions (one per worker share): every share reads the
    whole sequence, so any share that read past ``k`` anchors it; the nearest is used.
    """
    if not ks:
        return []
    anchor = _nearest(anchors, max(ks))
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
    after = [a for a in anchors if a is not None and a["next"] > k]
    if not after:  # a step is asked only where every share read past it: a damaged state otherwise
        raise NotAnswerable(f"no saved worker share of the mixture has read its sample {k}; the checkpoint's "
                            "positions disagree with its batch counts, so it cannot say which source that was")
    return min(after, key=lambda a: a["next"])


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
    picked = [pick(k) for k in range(first, stop)]  # one sweep covers every asked index
    counts = dict.fromkeys(anchor["drawn"], 0)
    at, i = {}, stop - first
    for k in sorted(set(ks), reverse=True):  # back from the anchor: each source's samples in [k, stop)
        while i > k - first:
            i -= 1
            counts[picked[i]] += 1
        name = picked[k - first]
        at[k] = (name, anchor["drawn"][name] - counts[name])
    return [at[k][0] for k in ks], [at[k][1] for k in ks]


def _child_items(anchor: Mapping[str, Any], name: str, items: list[int], epoch: int) -> list[dict]:
    """Items ``items`` of the mixture's source ``name``, named from the anchor's position of that source."""
    position, restarts = anchor["sources"][name], anchor["restarts"][name]
    drawn = anchor["drawn"][name]
    if position is None or (isinstance(position, int) and not isinstance(position, bool)):
        return [{"source": name, "document": _index(j, drawn, position or 0, restarts)} for j in items]
    if is_mixture(position):
        if restarts:
            return [_unknown(name, j, "it was read again from its start, and an inner Mixture's length is not "
                                      "recorded") for j in items]
        inner = name_items([position], items, epoch)
        return [dict(item, source=f"{name}/{item['source']}") for item in inner]
    opaque = opaque_kind(position)
    if opaque is not None:
        kind, why = opaque
        return [_unknown(name, j, f"it is a {kind}: {why}") for j in items]
    if restarts:
        return [_unknown(name, j, "it was read again from its start, and a stream's length is not recorded")
                for j in items]
    return [{"source": name, "document": j} for j in items]  # a stateful iterable: its j-th item this epoch


def _index(j: int, drawn: int, position: int, restarts: int) -> int:
    """The dataset index of a map-style source's ``j``-th drawn item, its anchor having drawn ``drawn`` items
    and standing at index ``position`` after ``restarts`` reads from its start (each ``len`` items long)."""
    last_start = drawn - position  # the drawn item that was index 0 of the latest read
    if j >= last_start:
        return j - last_start
    return j % (last_start // restarts)


def _unknown(name: str, j: int, why: str) -> dict:
    return {"source": name, "document": None, "item": j,
            "unknown": Unknown(f"source '{name}': its item {j} this epoch is known, not which document: {why}")}
