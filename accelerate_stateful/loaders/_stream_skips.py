"""Items of a composable source left out for good (``skip_samples`` on a stream): where the ranges go.

A composable source (``sources._global``) numbers its items with a global index, the same on every number of
processes and workers. The loader owns the ranges ``[epoch, start, stop]`` of those indices left out (saved
with its position as ``skipped_samples``, as a map-style loader saves its own), and at the start of every
pass puts the epoch's ranges into every share's starting state, where the outermost source reads them: it
reads the items in them and hands none to a worker. Persistent workers get them the same way, since each
pass's starting states are what the workers load.

Nothing here depends on how far a share has read, so every process decides the same: a range is checked for
its integers and its epoch only. Items of a range that a share delivered before the range was given stay
delivered; the pass that first applies the range says so in a warning (:func:`already_delivered`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ..checkpoint import _state as S
from ..errors import UnsupportedConfigError
from ..position import _skips
from ..sources._global import share_of
from ..sources._merge import epoch_mark_width
from ._snapshot import unpack


def check_new(epoch: Any, start: Any, stop: Any, *, current_epoch: int) -> None:
    """Refuse a range that is not ``0 <= start < stop`` integers, or that lies in a past epoch."""
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (epoch, start, stop)):
        raise UnsupportedConfigError(
            f"skip_samples({start!r}, {stop!r}, epoch={epoch!r}) needs integers; pass the range of the source's "
            "item indices as ints"
        )
    if not 0 <= start < stop:
        raise UnsupportedConfigError(
            f"skip_samples({start}, {stop}) is not a range of item indices; pass 0 <= start < stop (indices of the "
            "source's global sequence, counted from the epoch's start)"
        )
    if epoch < current_epoch:
        raise UnsupportedConfigError(
            f"skip_samples(..., epoch={epoch}): the loader is already in epoch {current_epoch}; items of a past "
            "epoch cannot be left out any more, resume from a checkpoint saved before them"
        )


def with_ranges(snapshots: Sequence[Optional[dict]], ranges: Sequence[Sequence[int]]) -> list[Optional[dict]]:
    """The shares' starting snapshots with the epoch's ``ranges`` (``(start, stop)``) in each source state.

    A share starting the epoch (``None``) gets the source's starting state with them. Without ranges the
    snapshots are returned as they are: the ranges of an epoch only grow while it runs, and a new epoch
    starts from no snapshot, so none holds ranges then.
    """
    if not ranges:
        return list(snapshots)
    return _with_source_field(snapshots, skip=[list(r) for r in ranges])


def _with_source_field(snapshots: Sequence[Optional[dict]], keep: bool = False, **field: Any) -> list[Optional[dict]]:
    """Each share's starting snapshot with ``field`` set in its source state (``keep``: where it has none yet); a
    share starting the epoch (``None``) gets the source's starting state with it."""
    found: list[Optional[dict]] = []
    for snapshot in snapshots:
        snap = None if snapshot is None else unpack(snapshot)
        state = dict((snap or {}).get("dataset") or {"index": 0, "position": None})
        state.update({key: value for key, value in field.items() if not (keep and key in state)})
        found.append(dict(snap or {"items": 0, "ended": False}, dataset=state))
    return found


def epoch_block(snapshots: Sequence[Optional[dict]], block: int) -> int:
    """The block of the epoch these shares' starting snapshots are in (``sources._global``): the one they were
    saved with (an epoch keeps its block); 1 (item by item) when a share has read without recording one, as
    before blocks were recorded; else, in an epoch no share has read from, ``block``, this loader's."""
    states = [unpack(snapshot)["dataset"] for snapshot in snapshots if snapshot is not None]
    for state in states:
        if "block" in state:
            return int(state["block"])
    return 1 if any(state["index"] > 0 for state in states) else block


def with_block(snapshots: Sequence[Optional[dict]], block: int) -> list[Optional[dict]]:
    """The shares' starting snapshots with the epoch's ``block`` in each source state (every share of an epoch
    splits the sequence alike); as they are for a block of 1, as before blocks were recorded."""
    if block == 1:
        return list(snapshots)
    return _with_source_field(snapshots, block=block)


def with_marks(snapshots: Sequence[Optional[dict]]) -> list[Optional[dict]]:
    """The shares' starting snapshots asking the outermost source to note where the sequence stands at the end of
    each block (``sources._global``: ``marks``, what ``samples`` names a packed row's documents by); the marks
    a share already has are kept, and once a share has noted some, every share notes them in their width
    (``_merge.epoch_mark_width``: a share that has noted none would note its cursor's own)."""
    width = epoch_mark_width([None if snap is None else unpack(snap).get("dataset") for snap in snapshots])
    return _with_source_field(snapshots, keep=True, marks=[], **({} if width is None else {"mark_width": width}))


def already_delivered(snapshots: Sequence[Optional[dict]], ranges: Sequence[Sequence[int]]) -> list[str]:
    """For each new ``(start, stop)`` range, a line when some share delivered items of it before it was given.

    Share ``w`` of ``n`` delivered the items of its blocks (``sources._global.share_of``) below its next index.
    """
    if not ranges:
        return []
    n = len(snapshots)
    states = [None if snap is None else unpack(snap)["dataset"] for snap in snapshots]
    nexts = [0 if state is None else int(state["index"]) for state in states]
    block = next((int(state.get("block", 1)) for state in states if state is not None), 1)
    lines = []
    for start, stop in ranges:
        passed = [w for w, at in enumerate(nexts) if any(
            share_of(k, n, block) == w for k in range(start, min(stop, at, start + n * block)))]
        if passed:
            lines.append(
                f"skip_samples({start}, {stop}): {len(passed)} of {n} reader shares had already delivered items of "
                f"this range before it was given (they read up to index {max(nexts[w] for w in passed)}); those "
                "stay delivered, the rest of the range is left out"
            )
    return lines


def saved_ranges(state_dict: Any, where: str) -> list[list[int]]:
    """The ranges a stream loader's state leaves out (none in a state of an earlier release)."""
    return _skips.check_saved(state_dict.get(S.SKIPPED, []), where)
