"""Elastic resume: a checkpoint written on W ranks continues on W' ranks (ranks simulated in one process).

Within the interrupted epoch every sample not consumed at save time is delivered exactly once across the
new ranks and none that was consumed comes back (besides the padding `even_batches` adds to complete the
last step, which `gather_for_metrics` drops, as in any run); later epochs are those of a fresh run on W'.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DataLoader

from accelerate_stateful import DispatchDataLoader, DistContext, ShardDataLoader

from harness import through_files
from streams import CountingStream

EPOCHS = 3


def shard(world, rank, n, batch_size, *, drop_last, even, split, workers=0):
    dl = DataLoader(list(range(n)), batch_size=batch_size, shuffle=True, drop_last=drop_last,
                    generator=torch.Generator().manual_seed(11), num_workers=workers)
    return ShardDataLoader.from_dataloader(dl, DistContext(rank, world), even_batches=even, split_batches=split)


def ids_of(batches):
    return [i for b in batches for i in b.tolist()]


def take(loader, steps):
    it = iter(loader)
    got = [next(it) for _ in range(steps)]
    state = loader.state_dict()
    del it
    return got, state


def epoch_rest(loader):
    """The rest of the current epoch, then the later epochs, as lists of batches."""
    epochs = [[b.tolist() for b in loader]]
    while loader.epoch < EPOCHS:
        epochs.append([b.tolist() for b in loader])
    return epochs


def _layouts():
    for world, new_world, drop, even, split in itertools.product([1, 2, 3], [1, 2, 3, 4], [False, True],
                                                                 [False, True], [False, True]):
        if world != new_world:
            yield pytest.param(world, new_world, drop, even, split,
                               id=f"{world}to{new_world}-{'drop' if drop else 'keep'}-{'even' if even else 'uneven'}"
                               + ("-split" if split else ""))


@pytest.mark.parametrize("world,new_world,drop,even,split", list(_layouts()))
def test_the_rest_of_the_epoch_is_delivered_once_and_later_epochs_are_a_fresh_runs(world, new_world, drop, even,
                                                                                     split):
    n = 37
    batch = 12 if split else 3  # divisible by every world size used when split
    old = [shard(world, r, n, batch, drop_last=drop, even=even, split=split) for r in range(world)]
    full_steps = len(old[-1])
    for steps in sorted({0, 1, full_steps // 2, full_steps - 1}):
        if steps < 0:
            continue
        consumed, states = [], []
        for loader in [shard(world, r, n, batch, drop_last=drop, even=even, split=split) for r in range(world)]:
            got, state = take(loader, steps)
            consumed += ids_of(got)
            states.append(through_files(state, loader.ctx.rank))
        order = ids_of([b for b in shard(1, 0, n, n, drop_last=False, even=False, split=False)])  # epoch 0's order
        resumed = [shard(new_world, r, n, batch, drop_last=drop, even=even, split=split) for r in range(new_world)]
        for loader in resumed:
            loader.load_state_dict(states[0])
        plan = resumed[0]._plan  # the resumed epoch's striping, before iterating moves on
        padding = plan.padding
        rests = [epoch_rest(loader) for loader in resumed]
        delivered = [i for rest in rests for b in rest[0] for i in b]
        unconsumed = [i for i in order if i not in set(consumed)]
        real = delivered if not padding else _without_padding(rests, new_world, plan)
        if drop:
            assert len(set(real)) == len(real) and set(real) <= set(unconsumed)
            assert len(unconsumed) - len(real) < plan.total_batch_size
        else:
            assert sorted(real) == sorted(unconsumed), f"{steps} steps"
        fresh = [shard(new_world, r, n, batch, drop_last=drop, even=even, split=split) for r in range(new_world)]
        for loader in fresh:
            loader.set_epoch(1)
        assert [rest[1:] for rest in rests] == [epoch_rest(loader) for loader in fresh]


def _without_padding(rests, world, plan):
    """The epoch's delivered ids in step order, cut where the real samples end."""
    ordered = [i for step in itertools.zip_longest(*[rest[0] for rest in rests], fillvalue=[]) for b in step for i in b]
    return ordered[: plan.num_samples - plan.origin]


@pytest.mark.parametrize("world,new_world", [(2, 3), (3, 2), (2, 1), (1, 2)])
@pytest.mark.parametrize("iterable", [False, True], ids=["map", "stream"])
def test_the_dispatcher_continues_on_another_world_size(world, new_world, iterable):
    def make(w, r):
        dataset = CountingStream(29) if iterable else list(range(29))
        return DispatchDataLoader.from_dataloader(DataLoader(dataset, batch_size=2), DistContext(r, w))

    def global_stream(loaders):
        per_rank = [[b.tolist() for b in loader] for loader in loaders]
        return [i for step in zip(*per_rank) for part in step for i in part]

    reference = global_stream([make(world, r) for r in range(world)])
    first = [make(world, r) for r in range(world)]
    taken, states = [], []
    for loader in first:
        got, state = take(loader, 3)
        taken += [i for b in got for i in b.tolist()]
        states.append(through_files(state, loader.ctx.rank))
    resumed = [make(new_world, r) for r in range(new_world)]
    for loader in resumed:
        loader.load_state_dict(states[0])
    rest = global_stream(resumed)
    assert sorted(set(taken + rest)) == list(range(29))
    assert len(taken) == 3 * world * 2 and set(taken).isdisjoint(set(rest[: 29 - len(taken)]))
    assert reference[: len(taken)] == sorted(taken, key=reference.index)
    fresh_epoch = global_stream([make(new_world, r) for r in range(new_world)])
    next_epoch = global_stream(resumed)
    assert next_epoch == fresh_epoch or iterable  # a stream's next epoch is the stream's own (CountingStream rotates)


def test_the_worker_count_may_change_together_with_the_world_size():
    state = through_files(take(shard(2, 0, 40, 4, drop_last=False, even=True, split=False, workers=2), 3)[1])
    resumed = [shard(3, r, 40, 4, drop_last=False, even=True, split=False, workers=0) for r in range(3)]
    for loader in resumed:
        loader.load_state_dict(state)
    delivered = sorted(i for loader in resumed for b in loader for i in b.tolist())
    assert len(delivered) == 40 - 24 + resumed[0]._plan.padding


def test_the_resume_log_line_reports_the_part_of_the_epoch_taken_and_the_topology_change(caplog):
    from pathlib import Path

    from accelerate_stateful.checkpoint._lines import log_resume as _log_resume

    _, state = take(shard(2, 0, 23, 3, drop_last=False, even=True, split=False), 2)  # 12 of 23 samples
    resumed = shard(3, 1, 23, 3, drop_last=False, even=True, split=False)
    resumed.load_state_dict(through_files(state))
    with caplog.at_level("INFO", logger="accelerate_stateful"):
        _log_resume(0, resumed, state, Path("ckpt"))
    assert "loader 0: resuming epoch 0 at 52.2% on 3 ranks x 0 workers (was 2 x 0) from ckpt" in caplog.text
    assert resumed.batches_yielded == 0  # the new ranks' plan starts at the first sample not yet taken


@pytest.mark.parametrize("world,new_world", [(w, v) for w in (1, 2, 3) for v in (1, 2, 3, 4) if w != v])
@pytest.mark.parametrize("n,batch_size", [(45, 4), (29, 2), (12, 3)])
@pytest.mark.parametrize("drop_last", [False, True], ids=["keep", "drop"])
def test_the_dispatchers_length_counts_what_it_yields_after_an_elastic_resume(world, new_world, n, batch_size,
                                                                              drop_last):
    def make(w, r):
        dl = DataLoader(list(range(n)), batch_size=batch_size, drop_last=drop_last)
        return DispatchDataLoader.from_dataloader(dl, DistContext(r, w))

    for steps in range(len(make(world, 0)) + 1):
        first = make(world, 0)
        _, state = take(first, steps)
        state = through_files(state, 0)
        resumed = [make(new_world, r) for r in range(new_world)]
        for loader in resumed:
            loader.load_state_dict(state)
        for loader in resumed:
            assert loader.epoch == 0  # a loop asking where it is (after the epoch's last batch: re-entering it)
            at, length = loader.batches_yielded, len(loader)
            ends = [loader.end_of_dataloader for _ in loader]
            assert at + len(ends) == length, (steps, loader.ctx.rank)
            assert not any(ends[:-1]) and ends[-1:] in ([], [True])
            # Saved again at the new size one batch later, and resumed there: the same length, the same rest.
            step_on = make(new_world, loader.ctx.rank)
            step_on.load_state_dict(state)
            got, mid = take(step_on, min(1, length - at))
            again = make(new_world, loader.ctx.rank)
            again.load_state_dict(through_files(mid, loader.ctx.rank))
            assert again.epoch == 0 and again.batches_yielded == at + len(got), (steps, loader.ctx.rank)
            if again.batches_yielded < length:  # (after the epoch's last batch the next epoch's length is reported)
                assert len(again) == length, (steps, loader.ctx.rank)
            assert at + len(got) + sum(1 for _ in again) == length, (steps, loader.ctx.rank)


@pytest.mark.parametrize("world,workers", [(4, 1), (6, 0), (12, 2)])
def test_the_dispatcher_saves_on_many_processes_with_fewer_workers_than_the_step_it_reads_ahead(world, workers):
    """The dispatcher reads a step (``world`` batches) ahead of the one the loop holds, and the workers prefetch
    beyond: the stream's state after the last batch taken must still be held when a checkpoint asks for it
    (the elastic grid found 4 processes with 1 worker refused: "worker 0 no longer holds its state")."""
    def make():
        dl = DataLoader(CountingStream(200), batch_size=2, num_workers=workers)
        return DispatchDataLoader.from_dataloader(dl, DistContext(0, world))

    reference = [b.tolist() for b in make()]
    loader = make()
    got, state = take(loader, 3)
    resumed = make()
    resumed.load_state_dict(through_files(state, 0))
    assert [b.tolist() for b in got] + [b.tolist() for b in resumed] == reference
