"""Pure arithmetic: how the batches of a user's ``batch_sampler`` are dealt to the ranks.

Accelerate shards a user's batch sampler with ``BatchSamplerShard``: without
``split_batches``, global step ``k`` gives rank ``r`` the sampler's batch
``k * world_size + r``; with it, each batch is cut into ``world_size`` slices.
The tail follows the sampler's ``drop_last`` and ``even_batches`` (the last
step completed from the epoch's first batches). :func:`deal` reproduces that
for all ranks at once, as a list of global steps, so a position is one number
every rank agrees on: the global steps taken. The sampler's batches a step
used up (``Step.consumed``) survive a change of world size: the rest of the
epoch, from the first batch nobody took, is dealt again to the new ranks
(``origin``), and padding still comes from the epoch's first batches.

On one process Accelerate keeps the user's batch sampler untouched, so each
batch is one step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

Batch = list  # a list of dataset indices


@dataclass(frozen=True)
class Step:
    """One global step: the sampler's batches used up once it is taken, and each rank's batch (or none)."""

    consumed: int
    batches: tuple[Optional[Batch], ...]


def deal(
    batches: Sequence[Batch],
    *,
    world_size: int,
    split_batches: bool,
    even_batches: bool,
    drop_last: bool,
    batch_size: Optional[int],
    origin: int = 0,
) -> list[Step]:
    """The epoch's global steps, dealing ``batches[origin:]`` as ``BatchSamplerShard`` would.

    Args:
        batches: Every batch the user's sampler drew in the epoch, in order.
        world_size: Number of ranks.
        split_batches: Cut each batch into ``world_size`` slices instead of one batch per rank.
        even_batches: Complete the last step from the epoch's first batches.
        drop_last: The sampler's ``drop_last`` attribute: no tail step at all.
        batch_size: The sampler's ``batch_size`` attribute (``None``: batches of any length).
        origin: How many of the epoch's batches were already dealt (on another world size).
    """
    if not 0 <= origin <= len(batches):
        raise ValueError(f"origin {origin} is outside the epoch's {len(batches)} batches")
    if world_size == 1:
        return [Step(origin + i + 1, (b,)) for i, b in enumerate(batches[origin:])]
    if split_batches:
        if batch_size is None or batch_size % world_size:
            raise ValueError(f"split_batches needs a batch_size divisible by {world_size}, got {batch_size}")
        return _deal_split(batches, origin, world_size, even_batches, drop_last, batch_size)
    return _deal_whole(batches, origin, world_size, even_batches, drop_last, batch_size)


def _deal_split(batches, origin, world, even, drop_last, batch_size) -> list[Step]:
    per_rank = batch_size // world
    cut = lambda b: tuple(list(b[per_rank * r: per_rank * (r + 1)]) for r in range(world))  # noqa: E731
    steps = [Step(origin + i + 1, cut(b)) for i, b in enumerate(batches[origin:]) if len(b) == batch_size]
    rest = batches[origin:]
    if drop_last or not rest or not batches[0] or len(rest[-1]) >= batch_size:
        return steps
    last = list(rest[-1])
    if not even:
        own = tuple(last[per_rank * r: per_rank * (r + 1)] if len(last) > per_rank * r else None for r in range(world))
        return steps + [Step(len(batches), own)]
    initial = list(batches[0])
    while len(initial) < batch_size:
        initial += initial
    return steps + [Step(len(batches), cut(last + initial))]


def _deal_whole(batches, origin, world, even, drop_last, batch_size) -> list[Step]:
    steps: list[Step] = []
    pending: list[Optional[Batch]] = [None] * world  # each rank's batch of the round not yet handed out
    rest = batches[origin:]
    for idx, batch in enumerate(rest):
        pending[idx % world] = batch  # batches are never changed, so they are shared, not copied
        if idx % world == world - 1 and (batch_size is None or len(batch) == batch_size):
            steps.append(Step(origin + idx + 1, tuple(pending)))
            pending = [None] * world
    if drop_last or not rest:
        return steps
    if not even:
        own = tuple(b if b else None for b in pending)
        return steps + ([Step(len(batches), own)] if any(own) else [])
    return steps + _padded_tail(batches, rest, pending, world, batch_size)


def _padded_tail(batches, rest, pending, world, batch_size) -> list[Step]:
    """The last round completed from the epoch's first batches (``BatchSamplerShard`` with ``even_batches``)."""
    first = batches[:world]
    initial: list = [list(b) for b in first] if batch_size is None else [i for b in first for i in b]
    if not initial:
        return []
    needed = world * batch_size if batch_size is not None else world
    while len(initial) < needed:
        initial += initial
    full = tuple(b if b and (batch_size is None or len(b) == batch_size) else None for b in pending)
    padded: list[Optional[Batch]] = [None] * world
    idx, batch = len(rest) - 1, list(rest[-1])
    if batch_size is None or len(batch) == batch_size:
        batch, idx = [], idx + 1
    cycle = 0
    while idx % world != 0 or batch:
        if batch_size is None:
            batch, cycle = initial[cycle], cycle + 1
        else:
            end = cycle + batch_size - len(batch)
            batch, cycle = batch + initial[cycle:end], end
        padded[idx % world] = batch
        batch, idx = [], idx + 1
    tail = [Step(len(batches), full)] if any(full) else []
    if any(padded):
        tail.append(Step(len(batches), tuple(padded)))
    return _merge_tail(tail)


def _merge_tail(tail: list[Step]) -> list[Step]:
    """One last step when no rank has two batches in it (always, but for samplers with short middle batches)."""
    if len(tail) == 2 and not any(a is not None and b is not None for a, b in zip(tail[0].batches, tail[1].batches)):
        merged = tuple(a if a is not None else b for a, b in zip(tail[0].batches, tail[1].batches))
        return [Step(tail[1].consumed, merged)]
    return tail


def rank_batches(steps: Sequence[Step], rank: int, start: int = 0) -> list[tuple[int, Batch]]:
    """``(steps taken once it is delivered, batch)`` for each of ``rank``'s batches from step ``start``."""
    return [(k + 1, s.batches[rank]) for k, s in enumerate(steps[start:], start) if s.batches[rank] is not None]
