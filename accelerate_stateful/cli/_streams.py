"""A stream loader's steps over a composable source, as the source's global item indices (``samples``).

Every rank reads the whole stream (``reading`` ``"whole"``) through ``L`` logical worker shares: share ``w``
keeps the items ``k`` of its blocks, ``(k // b) % L == w`` with the epoch's block ``b`` saved in each share's
position (1 if absent), but those left out with ``skip_samples``; it cuts them into global
batches of ``P * W`` items (``P`` per rank on ``W`` ranks) and hands rank ``r`` the ``r``-th ``P`` of each;
the loader takes the shares' batches round-robin from share 0 (``loaders/_stream``, ``_shares``), so rank
``r``'s step ``N`` is share ``N % L``'s batch ``N // L``. Under the dispatcher the main process's reader is
such a stream on one rank: global step ``N`` is its batches ``N * W`` to ``N * W + W - 1``, one per rank
(with ``split_batches``, its batch ``N`` cut in ``W``).

That layout holds from the epoch's start while every share runs. Each share's saved counts (the batches
taken from it, the index of its next item) are checked against it: a share reads nothing past its last
batch, so its next index must follow the last item of the batches the layout gives it. An epoch continued
on another number of processes or with another batch size, or one whose stream ended, is refused with the
reason, never guessed. Only steps already taken are answered: when a stream ends depends on its sources'
lengths, which a checkpoint does not record.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from ..checkpoint import _state as S
from ..position._skips import of_epoch
from ..sources._merge import mark_tuples
from ._composed import is_filtered, is_named, is_packed, opaque_kind
from ._read import NotAnswerable


@dataclass(frozen=True)
class Layout:
    """How one rank's steps map to global item indices: see the module docstring."""

    shares: int  # L, the epoch's logical worker shares
    per_rank: int  # P
    world: int  # W
    rank: int
    taken: int  # this rank's steps taken in the epoch
    epoch: int
    skip: tuple  # the epoch's [start, stop) ranges left out
    anchors: tuple  # each share's saved outermost position (``None``: not read yet)
    dispatched: bool = False
    split: bool = False
    block: int = 1  # the epoch's block of items dealt to one share in turn (``sources._global``)
    origin: int = 0  # the index the current dealing's blocks start at
    first: int = 0  # the loader's first batch of the current dealing (``loaders/_frontier``)
    regrouped: tuple = ()  # earlier dealings of the epoch: (first batch, origin, block, world size)


def is_composed(state: Mapping[str, Any]) -> bool:
    """Whether ``state`` is of a stream loader (or a dispatcher reading one) over a package's composable source."""
    reader = _reader(state)
    if reader is None:
        return False
    datasets = [snap.get("dataset") for snap in reader[S.STREAM].get("snapshots") or [] if snap is not None]
    return bool(datasets) and all(isinstance(d, Mapping) and {"index", "position"} <= set(d) for d in datasets)


def _reader(state: Mapping[str, Any]) -> Any:
    if state.get(S.MODE) == S.DISPATCH_MODE:
        state = state.get(S.BASE)
    return state if isinstance(state, Mapping) and state.get(S.MODE) == S.STREAM_MODE else None


def reader_stream(state: Mapping[str, Any]) -> Mapping[str, Any]:
    """The stream's saved state of a stream loader, or of a dispatcher's reader."""
    return _reader(state)[S.STREAM]


def layout(state: Mapping[str, Any], world: int) -> Layout:
    """The layout of the rank whose state this is, after checking the saved counts agree with it."""
    reader, dispatched = _reader(state), state[S.MODE] == S.DISPATCH_MODE
    stream, config = reader[S.STREAM], state[S.CONFIG]
    if stream.get("reading") != "whole":
        raise NotAnswerable("this stream is split between the processes by its own shards, not read whole by each; "
                            "samples names the items of the package's composable sources read whole")
    outer = [snap["dataset"]["position"] for snap in stream["snapshots"] if snap is not None]
    _refuse_opaque(outer)
    split = bool(config.get("split_batches"))
    per_rank = config["batch_size"] // world if split else config["batch_size"]
    found = Layout(
        shares=stream["workers"], per_rank=per_rank, world=world, rank=state[S.TOPOLOGY]["rank"],
        taken=state[S.BATCHES_YIELDED], epoch=state[S.EPOCH], skip=tuple(map(tuple, of_epoch(
            reader.get(S.SKIPPED, []), reader[S.EPOCH]))),
        anchors=tuple(None if snap is None else snap["dataset"]["position"] for snap in stream["snapshots"]),
        dispatched=dispatched, split=split,
        block=next((int(snap["dataset"].get("block", 1)) for snap in stream["snapshots"] if snap is not None), 1),
        origin=next((int(snap["dataset"].get("origin", 0)) for snap in stream["snapshots"] if snap is not None), 0),
        first=int(stream.get("before", 0)), regrouped=tuple(tuple(r) for r in stream.get("regrouped", ())))
    if any(piece[3] != reader[S.TOPOLOGY].get("world_size") for piece in found.regrouped):
        raise NotAnswerable("this checkpoint's epoch was continued on another number of processes, and samples "
                            "names a stream's samples only for an epoch read on one number of processes")
    _check_counts(found, reader, state)
    return found


def _refuse_opaque(outer: list) -> None:
    for position in outer:
        if position is None or is_named(position) or is_packed(position) or is_filtered(position):
            continue
        opaque = opaque_kind(position)
        why = f"its outermost source is a {opaque[0]}: {opaque[1]}" if opaque else "its outermost source's position " \
              "is not one samples can read"
        raise NotAnswerable(f"this stream's samples cannot be named from the checkpoint: {why}; samples names "
                            "the source and document of each sample of a Mixture or a Shuffled (with any sources "
                            "below it), the documents of a Packed's steps, and the items a Filtered's steps drew")


def _check_counts(found: Layout, reader: Mapping[str, Any], state: Mapping[str, Any]) -> None:
    """Refuse a checkpoint whose saved counts are not those of the layout from the epoch's start."""
    stream = reader[S.STREAM]
    batch = found.per_rank * (found.world if found.split or not found.dispatched else 1)  # a share's batch
    steps = reader[S.BATCHES_YIELDED] - found.first  # of the current dealing
    expected_steps = found.taken * (1 if found.split or not found.dispatched else found.world) - found.first
    trouble = None
    if found.dispatched and (steps != expected_steps or any(state.get("step_origin") or [])):
        trouble = "the dispatcher's reader and the processes' steps do not line up from the epoch's start"
    for w, snap in enumerate(stream["snapshots"]):
        taken = -(-(steps - w) // found.shares) if steps > w else 0
        items, index = taken * batch, 0 if snap is None else snap["dataset"]["index"]
        if snap is not None and snap.get("ended"):
            trouble = f"worker share {w} reached the end of the stream in this epoch"
        elif stream["taken"][w] != taken or (items and index != share_items(
                w, found.shares, found.skip, [items - 1], found.block, found.origin)[0] + 1):
            trouble = trouble or (f"worker share {w} stands at sample {index} after {stream['taken'][w]} batches, "
                                  f"not after {taken} batches of {batch} from the epoch's start")
    if trouble:
        raise NotAnswerable(
            f"this checkpoint's epoch is not laid out as one run from its start ({trouble}): it was continued on "
            "another number of processes, with another batch size, or its stream ended, and samples names a "
            "stream's samples only for an epoch read on one topology from its start"
        )


def share_items(w: int, shares: int, skip: tuple, js: list[int], block: int = 1, origin: int = 0) -> list[int]:
    """The global indices of share ``w``'s items ``js`` (the ``j``-th item it kept, for each ``j``): the items
    of its blocks of ``block`` from index ``origin``, every ``shares``-th block from block ``w``."""
    def own(i: int) -> int:  # the share's i-th item before any is left out
        return origin + ((i // block) * shares + w) * block + i % block

    if not skip:
        return [own(j) for j in js]
    wanted, found = set(js), {}
    ranges, i, j, last = list(skip), 0, 0, max(js)
    while j <= last:
        k = own(i)
        while ranges and k >= ranges[0][1]:
            ranges.pop(0)
        if not (ranges and ranges[0][0] <= k):  # kept: the share's item j
            if j in wanted:
                found[j] = k
            j += 1
        i += 1
    return [found[j] for j in js]


def step_items(found: Layout, step: int) -> list[int]:
    """The global item indices of the rank's ``step`` (one taken: ``step < found.taken``)."""
    per = found.per_rank
    if found.dispatched:  # the reader's batches: one per rank, or one cut in W
        size = per * (found.world if found.split else 1)
        batch = step if found.split else step * found.world + found.rank
        offset = found.rank * per if found.split else 0
    else:
        size, batch, offset = per * found.world, step, found.rank * per
    if batch < found.first:  # an earlier dealing: its batches were its blocks (of its batch size), in turn
        first, origin, block, _ = [piece for piece in found.regrouped if piece[0] <= batch][-1]
        cut = found.split or not found.dispatched  # a block cut between the ranks
        per_then = block // found.world if cut else block
        start = origin + (batch - first) * block + (found.rank * per_then if cut else 0)
        return list(range(start, start + per_then))
    share, number = (batch - found.first) % found.shares, (batch - found.first) // found.shares
    js = [number * size + offset + i for i in range(per)]
    return share_items(share, found.shares, found.skip, js, found.block, found.origin)


@dataclass(frozen=True)
class MarkWords:
    """How ``samples`` speaks of an outermost source named by its marks, in its refusals: its ``rows`` (left out by
    ``skip_samples``), what it ``names`` of a step, what a mark records (``stood``: "where the packed sequence
    stood"), which writers first ``noted`` it, and what is ``unknown`` without it."""

    rows: str
    names: str
    stood: str
    noted: str
    unknown: str


def marked_points(datasets: list, first: tuple, here: Callable[[Any], Optional[tuple]]) -> dict[int, tuple]:
    """Row index -> the outermost source's mark there (``_merge.mark_tuples``, the index left out), from every
    share's marks, the epoch's first row's ``first``, and each share's position at its next index where ``here``
    reads one from it (``None``: it does not)."""
    found: dict[int, tuple] = {0: first}
    for dataset in datasets:
        if dataset is None:
            continue
        found.update({mark[0]: mark[1:] for mark in mark_tuples(dataset)})
        point = here(dataset["position"])
        if point is not None:
            found[dataset["index"]] = point
    return found


def furthest(datasets: list, count: Callable[[Any], Optional[int]]) -> Optional[Any]:
    """The source position below the outermost source of the share whose ``count`` of its position is the largest
    (``None``: not that source's): it names every item that source read before."""
    found = [d["position"] for d in datasets if d is not None and count(d["position"]) is not None]
    return max(found, key=count)["source"] if found else None


def marked_step(layout: Layout, step: int, points: Mapping[int, tuple], words: MarkWords
                ) -> tuple[list[int], str, tuple[int, int], tuple, tuple]:
    """The rank's ``step`` as ``(indices, scope, span, before, after)``: its item indices, whose rows the marks
    around it name (``"this rank"`` where the rank's part is a whole span between marks; else the whole step's,
    ``"all ranks"``), that ``[start, stop)`` span of indices, and the marks (``points``: :func:`marked_points`) at
    its start and end. A step with rows
    left out by ``skip_samples`` in it is refused: they were read, not trained, and a span between marks holds
    them; so is a step whose ends no mark records (a checkpoint written before the source noted them)."""
    rows = step_items(layout, step)
    span, scope = (min(rows), max(rows) + 1), "this rank"
    if span[1] - span[0] != len(rows) or not {span[0], span[1]} <= set(points):
        everyone = [k for rank in range(layout.world)
                    for k in step_items(dataclasses.replace(layout, rank=rank), step)]
        span, scope = (min(everyone), max(everyone) + 1), "all ranks"
        if span[1] - span[0] != len(set(everyone)):
            raise NotAnswerable(f"step {step} holds {words.rows} left out by skip_samples, which were read but not "
                                f"trained; samples names {words.names} without such rows")
    missing = [k for k in span if k not in points]
    if missing:
        raise NotAnswerable(
            f"the checkpoint does not record {words.stood} at row {missing[0]}, the "
            f"{'start' if missing[0] == span[0] else 'end'} of step {step}: it was written before {words.noted} at "
            f"each worker batch's end, so {words.unknown} is not known"
        )
    return rows, scope, span, points[span[0]], points[span[1]]
