"""A dispatcher's batches as dataset indices, from its saved states alone, without torch (``samples``).

The dispatcher (``loaders/dispatch.py``) reads the epoch on the main process with a shard loader for one
process, its *reader*, whose state is nested under ``base``. A step concatenates ``group`` of the reader's
batches (one with ``split_batches``, else one per process), and rank ``r`` of ``world`` takes the ``r``-th of
``world`` equal parts. On one process the reader's batches are consecutive runs of the epoch's order, so a step
is one run of it and a rank's part is a run too: the reader's plan and the order ``_indices`` draws say it all,
and no loader has to run. The last step, when its samples do not divide by the number of processes (and not
``drop_last``), is completed with the first samples the loader read in the epoch, as many as there were processes
then, repeated where fewer, so that each part takes one sample more. A checkpoint holds those samples as the
run's data; as dataset indices they are the epoch order's first positions, as many as the saved batch is long.

The steps are counted as the loader counts them. After a resume on another number of processes the reader's
position stays where it was, the steps taken count as whole steps of the new size, and the rest of the epoch is
cut in steps of the new size from there (``DispatchDataLoader._restore``); a step before that cut began is shown
as a run of the whole epoch at this size would cut it (``_seek``'s rule). ``tests/test_cli_samples.py`` holds
every answer against the dispatchers themselves: what they took, and what they read when resumed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from ..checkpoint import _state as S
from ..checkpoint._compare import merged_state
from ..errors import CheckpointError
from ..loaders._passes import PASS
from ..position._plan import ShardPlan
from ..position._saved import shard_plan, striped_settings
from . import _indices
from ._position import _dispatcher, _step_origin, _steps_for, with_reader

# Up to the longest epoch ``_indices`` draws as torch does: rebuilt, a dispatcher runs over the epoch, which is
# slower than drawing the order at every length (benchmarks/bench_samples.py: 33 s against 2.9 s at 4,000,000).
MAX_SAMPLES = _indices.MAX_DRAWN


@dataclass(frozen=True)
class Cut:
    """Steps of one size over the reader's batches: step ``steps + k`` begins at the reader's batch
    ``read + k * group`` of ``reader``'s plan."""

    reader: ShardPlan
    read: int
    steps: int


@dataclass(frozen=True)
class Layout:
    """A dispatcher of ``world`` processes resumed from a checkpoint, as ``samples`` asks about it.

    Attributes:
        base: The main process's reader state: the epoch's order and the samples left out of it.
        epoch: The epoch the loader stands in.
        taken: Steps taken (``batches_yielded``).
        total: Steps in the epoch (``len()``).
        cut: Where the steps of this size began; the resumed loader reads on from step ``taken`` of it.
        first: How many of the epoch's first samples complete its last step (``None``: none read yet, so the
            first step read gives them).
        rank: The rank asked about.
        world: The number of processes it resumes on.
        group: The reader's batches in one step.
        drop_last: Whether a last step short of ``group`` batches is dropped (else it is completed).
    """

    base: Mapping[str, Any]
    epoch: int
    taken: int
    total: int
    cut: Cut
    first: Optional[int]
    rank: int
    world: int
    group: int
    drop_last: bool


def answerable(states: list, rank: int, world: int) -> bool:
    """Whether :func:`layout` answers for ``rank`` of ``world`` (else the loaders do): a dispatcher whose
    reader is a shard loader ``_indices`` answers for."""
    if not all(isinstance(state, Mapping) and state.get(S.MODE) == S.DISPATCH_MODE for state in states):
        return False
    base = with_reader(states, rank if len(states) == world else 0).get(S.BASE)
    return isinstance(base, Mapping) and _indices.answerable([base], 0, 1, limit=MAX_SAMPLES)


def layout(states: list, rank: int, world: int) -> Layout:
    """Where ``rank`` of ``world`` stands once resumed from every saved rank's ``states`` (its own on the saved
    world size, else all merged); raises as ``load_state_dict`` does for a state a resume refuses. A checkpoint
    taken right after an epoch's last step is that epoch, every step taken."""
    state = with_reader(states, rank) if len(states) == world else merged_state(states)
    _dispatcher(state, world, rank)  # the checks of validate_state
    base, config = state[S.BASE], state[S.CONFIG]
    group = 1 if config.get("split_batches", False) else world
    drop_last = config.get("drop_last", False)
    reader, _, _ = _indices.rank_position(base, 0, 1)
    if state[S.TOPOLOGY]["world_size"] == world:
        cut, taken = Cut(reader, *_step_origin(state)), state[S.BATCHES_YIELDED]
    else:  # the reader's position stays; the batches it took count as whole steps of the new size
        read = base[S.BATCHES_YIELDED]
        cut = Cut(reader, read, -(-read // group))
        taken = cut.steps
    total = cut.steps + _steps_for(reader.num_batches - cut.read, group, drop_last)
    entry = state.get(PASS)
    finished = bool(entry.get("complete", False)) if entry is not None else total > 0 and taken >= total
    if finished:  # the finished epoch, from its start, every step taken (``_stand_at_finished_epoch``)
        epoch = state[S.EPOCH] if entry is None else entry["origin"]["epoch"]
        whole = _whole_epoch(base, epoch)
        total = _steps_for(whole.num_batches, group, drop_last)
        return Layout(base, epoch, total, total, Cut(whole, 0, 0), None, rank, world, group, drop_last)
    first = _first_count(state.get(S.FIRST_SAMPLES))
    return Layout(base, state[S.EPOCH], taken, total, cut, first, rank, world, group, drop_last)


def batches(layout: Layout, start: int, stop: Optional[int]) -> list[list[int]]:
    """This rank's steps ``start`` to ``stop`` (exclusive; ``None``: the epoch's end), as dataset indices."""
    order = _indices.epoch_order(layout.base, layout.epoch)
    cut = layout.cut
    stop = layout.total if stop is None else min(stop, layout.total)
    found = []
    if start < cut.steps:  # before this cut began: a run of the whole epoch at this size
        whole = Cut(_whole_epoch(layout.base, layout.epoch), 0, 0)
        first = _step_samples(order, layout, whole, 0)[:layout.world]
        found = [_part(order, layout, whole, step, first) for step in range(start, min(stop, cut.steps))]
        start = cut.steps
    if start < stop:
        first = _first_samples(order, layout)
        found += [_part(order, layout, cut, step, first) for step in range(start, stop)]
    return found


def _first_samples(order: list[int], layout: Layout) -> list[int]:
    """The samples a last step of the cut is completed with: the epoch's first, as many as the state holds;
    without them, those of the first step the resumed loader reads (where it stands, or after the epoch's last
    step, which it reads again from the start)."""
    if layout.first is not None:
        return order[:layout.first]
    step = layout.taken if layout.taken < layout.total else layout.cut.steps
    return _step_samples(order, layout, layout.cut, step)[:layout.world]


def _part(order: list[int], layout: Layout, cut: Cut, step: int, first: list[int]) -> list[int]:
    """This rank's part of ``step`` of ``cut``: one of ``world`` equal parts, the last step completed with
    ``first`` (repeated up to ``world`` samples) where it does not divide."""
    samples = _step_samples(order, layout, cut, step)
    world, rank = layout.world, layout.rank
    per_rank = len(samples) // world
    if _is_last(layout, cut, step) and not layout.drop_last and len(samples) % world:
        samples += (first * -(-world // len(first)))[:world]  # (``first`` doubled until it has ``world``)
        per_rank += 1
    return samples[rank * per_rank:(rank + 1) * per_rank]


def _step_samples(order: list[int], layout: Layout, cut: Cut, step: int) -> list[int]:
    """The dataset indices of ``step`` of ``cut``, all ranks': its reader batches, one run of the order."""
    begin = cut.read + (step - cut.steps) * layout.group
    end = min(begin + layout.group, cut.reader.num_batches)
    return order[cut.reader.batch_span(begin)[0]:cut.reader.batch_span(end - 1)[1]]


def _is_last(layout: Layout, cut: Cut, step: int) -> bool:
    """Whether no step of ``cut`` follows ``step``: the reader's batches left make none (``drop_last``: no whole
    one)."""
    left = cut.reader.num_batches - (cut.read + (step + 1 - cut.steps) * layout.group)
    return left <= 0 or (layout.drop_last and left < layout.group)


def _whole_epoch(base: Mapping[str, Any], epoch: int) -> ShardPlan:
    """The reader's plan of ``epoch`` from its start (``ShardDataLoader._rewind``)."""
    return shard_plan(striped_settings(base[S.CONFIG], {**base, S.EPOCH: epoch}), 1, 0, 0)


def _first_count(first: Any) -> Optional[int]:
    """How many samples the saved first samples hold: the length of their first tensor, as Accelerate's
    ``find_batch_size`` reads a batch (a tensor is a ``SavedTensor`` here, read without torch)."""
    found = first
    while isinstance(found, (list, tuple, Mapping)) and found:
        found = next(iter(found.values())) if isinstance(found, Mapping) else found[0]
    shape = getattr(found, "shape", None)
    if first is not None and not (shape and isinstance(shape[0], int) and shape[0] >= 1):
        raise CheckpointError(
            "the dispatcher's saved first samples of the epoch, which complete its last step, are not a batch of "
            "tensors; the file is damaged or was edited by hand, resume from another checkpoint"
        )
    return None if first is None else int(shape[0])
