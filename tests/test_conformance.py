"""Exact resume of the shard and skip loaders, on ranks simulated in one process.

Most of the coverage lives here: many configurations, every kind of save
point, successive resumes, states round-tripped through the on-disk format.
``test_multiprocess.py`` repeats a covering set of it with real processes.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from accelerate_stateful import DistContext, ShardDataLoader, SkipDataLoader

from harness import check_resumes, run_loop, save_points

EPOCHS = 3


class Ids(Dataset):
    """Sample ``i`` is the id ``i``: what the loop sees is exactly which samples it got."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class EveryOther(Sampler[int]):
    """A user's own sampler: even ids first, shuffled by the global RNG."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        evens = list(range(0, self.n, 2))
        odds = list(range(1, self.n, 2))
        perm = torch.randperm(len(evens)).tolist()
        return iter([evens[i] for i in perm] + odds)


def make_factory(n, batch_size, world, rank, *, shuffle="random", drop_last=False, even=True, split=False,
                 num_workers=0):
    def make():
        torch.manual_seed(4321)  # what accelerate.utils.set_seed does at the top of a script
        kwargs = {}
        if shuffle == "random":
            kwargs = {"shuffle": True, "generator": torch.Generator().manual_seed(1234)}
        elif shuffle == "custom":
            kwargs = {"sampler": EveryOther(n)}
        dl = DataLoader(Ids(n), batch_size=batch_size, drop_last=drop_last, num_workers=num_workers, **kwargs)
        return ShardDataLoader.from_dataloader(
            dl, DistContext(rank, world), even_batches=even, split_batches=split, data_seed=None
        )

    return make


def _configs():
    grid = itertools.product(
        [1, 2, 3],  # world size
        [7, 23],  # dataset length (never a multiple of the batch size below... except by chance)
        [2, 4],  # batch size
        ["sequential", "random", "custom"],
        [False, True],  # drop_last
        [False, True],  # even_batches
        [False, True],  # split_batches
    )
    for world, n, bs, shuffle, drop, even, split in grid:
        if split and bs % world:
            continue
        cid = f"w{world}-n{n}-b{bs}-{shuffle}-{'drop' if drop else 'keep'}-{'even' if even else 'uneven'}" + (
            "-split" if split else ""
        )
        yield pytest.param(world, n, bs, shuffle, drop, even, split, id=cid)


@pytest.mark.parametrize("world,n,bs,shuffle,drop,even,split", list(_configs()))
def test_every_save_point_resumes_to_the_uninterrupted_stream(world, n, bs, shuffle, drop, even, split):
    for rank in range(world):
        make = make_factory(n, bs, world, rank, shuffle=shuffle, drop_last=drop, even=even, split=split)
        reference, _ = run_loop(make(), EPOCHS)
        points = save_points(reference)
        chains = [[p] for p in points]
        rng = random.Random(f"{world}{n}{bs}{shuffle}{drop}{even}{split}{rank}")
        for length in (2, 3):
            for _ in range(3):
                chains.append(sorted(rng.sample(points, min(length, len(points)))))
        check_resumes(make, EPOCHS, chains, reference, rank)


@pytest.mark.parametrize("world,rank", [(1, 0), (2, 1), (3, 2)])
@pytest.mark.parametrize("shuffle", ["random", "custom"])
def test_workers_resume_exactly_and_may_change_count(world, rank, shuffle):
    """With worker processes the stream is the same, and a checkpoint taken with 2 workers resumes with 0 or 3."""
    with_workers = make_factory(23, 3, world, rank, shuffle=shuffle, num_workers=2)
    reference, _ = run_loop(make_factory(23, 3, world, rank, shuffle=shuffle)(), EPOCHS)
    assert run_loop(with_workers(), EPOCHS)[0] == reference
    chains = [[(1, "in_loop")], [(len(reference) // 2, "in_loop"), (len(reference) - 2, "in_loop")]]
    check_resumes(with_workers, EPOCHS, chains, reference, rank)
    for resumed_workers in (0, 3):
        steps, state = run_loop(with_workers(), EPOCHS, stop=(5, "in_loop"))
        other = make_factory(23, 3, world, rank, shuffle=shuffle, num_workers=resumed_workers)()
        other.load_state_dict(state)
        rest, _ = run_loop(other, EPOCHS, taken=5)
        assert steps + rest == reference


def test_an_epochs_order_does_not_depend_on_world_size():
    def epoch_order(world):
        loaders = [make_factory(24, 2, world, r)() for r in range(world)]
        per_rank = [[list(b.tolist()) for b in dl] for dl in loaders]
        order = []
        for step in range(len(per_rank[0])):
            for rank in range(world):
                order += per_rank[rank][step]
        return order

    assert epoch_order(1) == epoch_order(2) == epoch_order(3)
    assert sorted(epoch_order(1)) == list(range(24))


def test_an_epochs_order_does_not_depend_on_the_global_rng():
    make = make_factory(30, 4, 2, 0)
    torch.manual_seed(0)
    first = run_loop(make(), EPOCHS)[0]
    torch.manual_seed(99)
    loader = make()
    torch.manual_seed(5)
    assert run_loop(loader, EPOCHS)[0] == first


def test_epochs_differ_and_each_covers_the_dataset_once():
    loaders = [make_factory(24, 4, 2, r)() for r in range(2)]
    epochs = []
    for _ in range(EPOCHS):
        ids = [i for dl in loaders for batch in dl for i in batch.tolist()]
        assert sorted(ids) == list(range(24))
        epochs.append(ids)
    assert epochs[0] != epochs[1] != epochs[2]


@pytest.mark.parametrize("world,n,bs,even", [(2, 23, 4, True), (3, 23, 2, False), (2, 7, 4, True)])
def test_skip_first_batches_starts_there_without_reading_and_stays_exact(world, n, bs, even):
    for rank in range(world):
        reference, _ = run_loop(make_factory(n, bs, world, rank, even=even)(), EPOCHS)
        first_epoch = [s for s in reference if s.epoch == 0]
        for k in range(len(first_epoch) + 1):
            skipped = SkipDataLoader(make_factory(n, bs, world, rank, even=even)(), k)
            seen, state = run_loop(skipped, EPOCHS, stop=(min(k + 1, len(first_epoch)) - k, "in_loop"))
            resumed = make_factory(n, bs, world, rank, even=even)()
            resumed.load_state_dict(state)
            seen += run_loop(resumed, EPOCHS)[0]
            assert seen == reference[k:], f"rank {rank} skip {k}"


def test_skip_reads_no_sample_before_its_start():
    touched = []

    class Recording(Ids):
        def __getitem__(self, i):
            touched.append(i)
            return i

    dl = DataLoader(Recording(100), batch_size=10)
    loader = SkipDataLoader(ShardDataLoader.from_dataloader(dl, DistContext(0, 1)), 7)
    assert [b.tolist() for b in loader] == [list(range(70, 80)), list(range(80, 90)), list(range(90, 100))]
    assert touched == list(range(70, 100))


def test_resume_reads_no_sample_it_does_not_deliver():
    touched = []

    class Recording(Ids):
        def __getitem__(self, i):
            touched.append(i)
            return i

    def make():
        dl = DataLoader(Recording(1000), batch_size=10, shuffle=True, generator=torch.Generator().manual_seed(3))
        return ShardDataLoader.from_dataloader(dl, DistContext(1, 2))

    first = make()
    it = iter(first)
    for _ in range(30):
        next(it)
    state = first.state_dict()
    del it
    touched.clear()
    resumed = make()
    resumed.load_state_dict(state)
    delivered = [i for batch in resumed for i in batch.tolist()]
    assert touched == delivered
    assert len(delivered) == (50 - 30) * 10
