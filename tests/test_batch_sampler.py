"""A user's own ``batch_sampler``: dealt as Accelerate deals it, resumed exactly, re-dealt on another world size."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler

from accelerate_stateful import BatchSamplerDataLoader, DistContext, StateMismatchError, UnsupportedConfigError
from accelerate_stateful.position._deal import deal, rank_batches

from harness import check_resumes, run_loop, save_points, through_files

EPOCHS = 3


class ListBatches:
    """A batch sampler replaying fixed batches, with Accelerate's optional attributes."""

    def __init__(self, batches, batch_size, drop_last):
        self.batches, self.drop_last = batches, drop_last
        if batch_size is not None:
            self.batch_size = batch_size

    def __iter__(self):
        return iter([list(b) for b in self.batches])

    def __len__(self):
        return len(self.batches)


def _batch_lists():
    rng = random.Random(0)
    for n, size in itertools.product(range(0, 12), range(1, 5)):
        ids = list(range(n))
        yield [ids[i:i + size] for i in range(0, n, size)], size
    for _ in range(120):
        n, batches, i = rng.randrange(0, 18), [], 0
        while i < n:
            k = rng.randrange(1, 5)
            batches.append(list(range(i, min(n, i + k))))
            i += k
        yield batches, None  # batches of any length (length bucketing, token budgets)
        yield batches, 3  # a batch_size attribute some batches do not have


def test_deal_reproduces_accelerates_batch_sampler_shard_for_every_layout():
    checked = 0
    for batches, size in _batch_lists():
        for world, split, even, drop in itertools.product(range(2, 5), *[[False, True]] * 3):
            if split and (size is None or size % world):
                continue
            steps = deal(batches, world_size=world, split_batches=split, even_batches=even, drop_last=drop,
                         batch_size=size)
            assert [s.consumed for s in steps] == sorted(s.consumed for s in steps)
            for rank in range(world):
                shard = BatchSamplerShard(ListBatches(batches, size, drop), world, rank, split_batches=split,
                                          even_batches=even)
                assert [b for _, b in rank_batches(steps, rank)] == list(shard), (batches, size, world, rank)
                checked += 1
    assert checked > 10000


def test_dealing_from_an_origin_delivers_every_remaining_batch_once():
    for batches, size in _batch_lists():
        if size is not None:
            continue
        for world, origin in itertools.product(range(1, 5), range(len(batches) + 1)):
            steps = deal(batches, world_size=world, split_batches=False, even_batches=False, drop_last=False,
                         batch_size=None, origin=origin)
            got = sorted(tuple(b) for r in range(world) for _, b in rank_batches(steps, r))
            assert got == sorted(tuple(b) for b in batches[origin:])


class Bucketing(Sampler):
    """Length bucketing: batches of 1, 2, 3, 1, 2, 3… ids; deterministic, no batch_size."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        start, size = 0, 1
        while start < self.n:
            yield list(range(start, min(self.n, start + size)))
            start, size = start + size, size % 3 + 1

    def __len__(self):
        return -(-self.n * 3 // 6)


class TokenBudget(Sampler):
    """Batches whose summed token count stays under a budget, shuffled per epoch by ``set_epoch``."""

    def __init__(self, lengths, budget):
        self.lengths, self.budget, self.epoch = lengths, budget, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        order = list(range(len(self.lengths)))
        random.Random(self.epoch).shuffle(order)
        batch, used = [], 0
        for i in order:
            if batch and used + self.lengths[i] > self.budget:
                yield batch
                batch, used = [], 0
            batch.append(i)
            used += self.lengths[i]
        if batch:
            yield batch

    def __len__(self):
        return len(self.lengths)


def make_sampler(kind, n):
    if kind == "bucketing":
        return Bucketing(n)
    if kind == "token-budget":
        return TokenBudget([1 + (7 * i) % 5 for i in range(n)], budget=7)
    return BatchSampler(RandomSampler(range(n), generator=torch.Generator().manual_seed(5)), 3, kind == "drop")


def loader(kind, n, world, rank, *, workers=0, even=True, split=False):
    dl = DataLoader(list(range(n)), batch_sampler=make_sampler(kind, n), num_workers=workers)
    return BatchSamplerDataLoader.from_dataloader(dl, DistContext(rank, world), even_batches=even,
                                                  split_batches=split)


KINDS = ["bucketing", "token-budget", "shuffled", "drop"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world,even", [(1, True), (2, True), (3, False)])
def test_every_save_point_resumes_exactly_on_every_rank(kind, world, even):
    for rank in range(world):
        make = lambda: loader(kind, 13, world, rank, even=even)  # noqa: E731
        reference, _ = run_loop(make(), EPOCHS)
        check_resumes(make, EPOCHS, [[p] for p in save_points(reference)] + [save_points(reference)[1:4:2]],
                      reference, rank=rank)


def test_workers_two_resume_exactly_and_match_no_workers():
    make = lambda: loader("token-budget", 14, 2, 1, workers=2)  # noqa: E731
    reference, _ = run_loop(loader("token-budget", 14, 2, 1), EPOCHS)
    points = save_points(reference)
    check_resumes(make, EPOCHS, [[points[2]], [points[len(points) // 2], points[-2]]], reference, rank=1)


def test_a_shuffled_sampler_draws_another_order_each_epoch_and_split_batches_slices_each_batch():
    ranks = [loader("drop", 12, 3, r, split=True) for r in range(3)]
    epochs = [[[b.tolist() for b in dl] for dl in ranks] for _ in range(2)]
    for per_rank in epochs:
        assert all(len(b) == 1 for batches in per_rank for b in batches)
        assert sorted(i for batches in per_rank for b in batches for i in b) == list(range(12))
    assert epochs[0] != epochs[1]


def _taken_and_rest(kind, world, new_world, steps, *, even):
    old = [loader(kind, 19, world, r, even=even) for r in range(world)]
    states, taken = [], []
    for dl in old:
        it = iter(dl)
        taken += [i for _ in range(steps) for i in next(it).tolist()]
        states.append(through_files(dl.state_dict(), dl.ctx.rank))
        del it
    new = [loader(kind, 19, new_world, r, even=even) for r in range(new_world)]
    merged = new[0].merge_rank_states(states) if world != new_world else None
    rest, later = [], []
    for dl in new:
        dl.load_state_dict(merged if merged is not None else states[dl.ctx.rank])
        rest += [i for b in dl for i in b.tolist()]
        later.append([b.tolist() for b in dl])
    fresh = [loader(kind, 19, new_world, r, even=even) for r in range(new_world)]
    for dl in fresh:
        list(dl)
    assert later == [[b.tolist() for b in dl] for dl in fresh]  # the next epoch is a fresh run's
    return taken, rest


@pytest.mark.parametrize("world,new_world", [(1, 2), (2, 3), (3, 2), (2, 1), (3, 1)])
@pytest.mark.parametrize("kind", ["bucketing", "token-budget", "shuffled"])
def test_on_another_world_size_the_rest_of_the_epoch_comes_once(kind, world, new_world):
    for steps in (0, 1, 2):
        taken, rest = _taken_and_rest(kind, world, new_world, steps, even=False)
        assert not set(taken) & set(rest)
        assert sorted(taken + rest) == list(range(19))


def test_split_batches_on_a_world_size_that_does_not_divide_the_batch_is_refused_in_user_terms():
    state = loader("drop", 12, 3, 0, split=True).state_dict()
    other = loader("drop", 12, 2, 0)
    other._split_batches = True
    with pytest.raises(UnsupportedConfigError, match="batch_size attribute divisible by 2"):
        other.validate_state(state)
    with pytest.raises(UnsupportedConfigError, match="split_batches=False"):
        loader("bucketing", 12, 2, 0, split=True)


def test_a_sampler_that_draws_other_batches_for_the_same_epoch_is_refused():
    dl = loader("bucketing", 19, 2, 0)
    it = iter(dl)
    for _ in range(3):  # mid-epoch (the epoch has 5 batches on this rank)
        next(it)
    state = dl.state_dict()
    del it
    shorter = loader("bucketing", 7, 2, 0)
    shorter._config = dl._config
    with pytest.raises(StateMismatchError, match=r"sampler's order for epoch 0 \(Bucketing\) differs from the one saved"):
        shorter.load_state_dict(state)
    older = {key: value for key, value in state.items() if key != "order_fingerprint"}  # an earlier release's
    with pytest.raises(UnsupportedConfigError, match="same batches for the same seed and epoch"):
        shorter.load_state_dict(older)


@pytest.mark.parametrize("kind", ["token-budget", "drop"])
def test_dispatched_the_main_process_reads_the_batch_sampler_and_resumes_exactly(kind):
    from accelerate_stateful import DispatchDataLoader

    def make():
        dl = DataLoader(list(range(13)), batch_sampler=make_sampler(kind, 13))
        return DispatchDataLoader.from_dataloader(dl, DistContext(1, 2))

    reference, _ = run_loop(make(), EPOCHS)
    assert isinstance(make().reader, BatchSamplerDataLoader)
    points = save_points(reference)
    check_resumes(make, EPOCHS, [[p] for p in points[::2]], reference, rank=1)
