"""A custom sampler's own RNG, under any name, resumes every epoch in the same order; a changed order is refused.

Every loader here is built afresh for each link of a resume chain, with a freshly constructed sampler, as a
new process builds it: an RNG the package did not reseed would start over from its constructor's state.
"""

from __future__ import annotations

import random
import types

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Sampler

from accelerate_stateful import (
    BatchSamplerDataLoader,
    DistContext,
    ShardDataLoader,
    StateMismatchError,
    UnsupportedConfigError,
)
from accelerate_stateful.position._sampler_rng import held_rngs

from harness import check_resumes, run_loop, save_points, through_files

N, EPOCHS = 23, 3


class Holding(Sampler):
    """Shuffles with RNGs kept wherever ``place`` puts them, never under the name ``generator``."""

    def __init__(self, n: int, place: str, seed: int = 5) -> None:
        self.n, self.place = n, place
        if place == "attribute":
            self.rng = torch.Generator().manual_seed(seed)
        elif place == "list":
            self.rngs = [torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)]
        elif place == "dict":
            self.rngs = {"order": torch.Generator().manual_seed(seed)}
        elif place == "helper":
            self.state = types.SimpleNamespace(rng=torch.Generator().manual_seed(seed))
        elif place == "numpy":
            self.rng = np.random.default_rng(seed)
        elif place == "random":
            self.rng = random.Random(seed)

    def __iter__(self):
        place = self.place
        if place == "attribute":
            return iter(torch.randperm(self.n, generator=self.rng).tolist())
        if place == "list":  # two generators, each drawing its part of the order
            first = torch.randperm(self.n, generator=self.rngs[0]).tolist()
            swap = torch.randint(0, 2, (1,), generator=self.rngs[1]).item()
            return iter(first[::-1] if swap else first)
        if place == "dict":
            return iter(torch.randperm(self.n, generator=self.rngs["order"]).tolist())
        if place == "helper":
            return iter(torch.randperm(self.n, generator=self.state.rng).tolist())
        if place == "numpy":
            return iter(self.rng.permutation(self.n).tolist())
        order = list(range(self.n))
        self.rng.shuffle(order)
        return iter(order)

    def __len__(self) -> int:
        return self.n


PLACES = ["attribute", "list", "dict", "helper", "numpy", "random"]


def shard(place, world=1, rank=0, workers=0, drop_last=False, seed=5):
    dl = DataLoader(list(range(N)), batch_size=3, sampler=Holding(N, place, seed), num_workers=workers,
                    drop_last=drop_last)
    return ShardDataLoader.from_dataloader(dl, DistContext(rank, world), data_seed=7)


def batched(place, world=1, rank=0, seed=5):
    dl = DataLoader(list(range(N)), batch_sampler=BatchSampler(Holding(N, place, seed), 4, drop_last=False))
    return BatchSamplerDataLoader.from_dataloader(dl, DistContext(rank, world), data_seed=7)


def chains_for(reference):
    points = save_points(reference)
    return [[p] for p in points] + [[p for p in points if p[1] == "in_loop"][1::3]]


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("world,workers,drop_last", [(1, 0, False), (2, 0, True), (3, 2, False)],
                         ids=["1rank", "2ranks-drop", "3ranks-2workers"])
def test_every_epoch_after_a_resume_is_drawn_in_the_uninterrupted_order(place, world, workers, drop_last):
    for rank in range(world):
        def make():
            return shard(place, world, rank, workers if rank == 0 else 0, drop_last)

        reference, _ = run_loop(make(), EPOCHS)
        epochs = [[s.ids for s in reference if s.epoch == e] for e in range(EPOCHS)]
        assert epochs[1] != epochs[2], "the sampler must shuffle each epoch differently for this test to mean much"
        check_resumes(make, EPOCHS, chains_for(reference), reference, rank=rank)


@pytest.mark.parametrize("place", PLACES)
def test_a_batch_sampler_over_such_a_sampler_resumes_every_epoch_exactly(place):
    for world, rank in ((1, 0), (2, 1)):
        reference, _ = run_loop(batched(place, world, rank), EPOCHS)
        check_resumes(lambda: batched(place, world, rank), EPOCHS, chains_for(reference), reference, rank=rank)


def test_the_walk_finds_every_rng_in_a_deterministic_order_and_skips_the_dataset():
    data = [torch.Generator()]  # a dataset that holds a generator: not the sampler's
    sampler = Holding(4, "list")
    sampler.data_source = data
    sampler.nested = {"b": random.Random(1), "a": [np.random.RandomState(2)]}
    found = [path for path, _ in held_rngs(sampler, (data,))]
    assert found == [".nested['a'][0]", ".nested['b']", ".rngs[0]", ".rngs[1]"]
    assert [path for path, _ in held_rngs(sampler, (data,))] == found


@pytest.mark.parametrize("place", ["attribute", "numpy"])
def test_the_seed_of_a_samplers_own_generator_is_the_loaders_and_a_change_is_refused(place):
    def make(seed):
        dl = DataLoader(list(range(N)), batch_size=3, sampler=Holding(N, place, seed))
        return ShardDataLoader.from_dataloader(dl, DistContext())

    loader = make(5)
    for batch in loader:
        pass
    it = iter(loader)
    next(it)
    state = through_files(loader.state_dict())
    del it
    other = make(6)
    if place == "attribute":  # a torch.Generator's seed is the user's choice of the loader's seed
        assert (loader.seed, loader.seed_source) == (5, "generator")
        before = other.state_dict()
        with pytest.raises(StateMismatchError, match=r"data seed .*: saved 5, current 6"):
            other.load_state_dict(state)
        assert other.state_dict() == before
    else:  # no torch.Generator: the seed was drawn, and the checkpoint's is taken with its order
        assert loader.seed_source == "drawn"
        same = make(5)
        other.load_state_dict(state)
        same.load_state_dict(state)
        assert [b.tolist() for b in other] == [b.tolist() for b in same]


class SeedsItself(Sampler):
    """Like DistributedSampler: draws its order from its own seed and the epoch, in __iter__."""

    def __init__(self, n, seed):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist())

    def __len__(self):
        return self.n


@pytest.mark.parametrize("epoch", [0, 1, 2])
def test_a_sampler_that_seeds_itself_differently_is_refused_not_continued(epoch):
    def make(seed):
        dl = DataLoader(list(range(N)), batch_size=3, sampler=SeedsItself(N, seed))
        return ShardDataLoader.from_dataloader(dl, DistContext(), data_seed=7)

    loader = make(1)
    loader.set_epoch(epoch)
    it = iter(loader)
    next(it)
    state = through_files(loader.state_dict())
    del it
    changed = make(2)
    before = changed.state_dict()
    with pytest.raises(StateMismatchError, match=(
            rf"sampler's order of the saved epoch .*\nthe sampler's order for epoch {epoch} \(SeedsItself\) differs "
            r"from the one saved \(seed changed\?\).*restore the same sampler seed.*or start a fresh run")):
        changed.load_state_dict(state)
    assert changed.state_dict() == before
    make(1).load_state_dict(state)  # the same seed: accepted


def test_a_state_without_a_fingerprint_from_an_earlier_release_still_loads():
    loader = ShardDataLoader.from_dataloader(
        DataLoader(list(range(N)), batch_size=3, sampler=SeedsItself(N, 1)), DistContext(), data_seed=7)
    it = iter(loader)
    taken = [next(it).tolist() for _ in range(2)]
    state = {k: v for k, v in through_files(loader.state_dict()).items() if k != "order_fingerprint"}
    del it
    again = ShardDataLoader.from_dataloader(
        DataLoader(list(range(N)), batch_size=3, sampler=SeedsItself(N, 1)), DistContext(), data_seed=7)
    again.load_state_dict(state)
    rest = [b.tolist() for b in again]
    assert sorted(i for b in taken + rest for i in b) == list(range(N))


def test_an_earlier_releases_state_of_a_sampler_whose_rng_it_did_not_seed_is_refused():
    loader = shard("attribute")
    it = iter(loader)
    next(it)
    state = {k: v for k, v in loader.state_dict().items() if k != "order_fingerprint"}
    del it
    with pytest.raises(UnsupportedConfigError, match=r"earlier release, which did not seed the random generator\(s\) "
                                                     r"rng of Holding.*start a fresh run"):
        shard("attribute").load_state_dict(state)


class Unreachable(Sampler):
    """Keeps its RNG in a closure: nothing can reseed it, so each draw differs."""

    def __init__(self, n):
        generator = torch.Generator().manual_seed(0)
        self.n, self.draw = n, lambda: torch.randperm(n, generator=generator).tolist()

    def __iter__(self):
        return iter(self.draw())

    def __len__(self):
        return self.n


@pytest.mark.parametrize("kind", ["shard", "batch-sampler"])
def test_a_sampler_whose_randomness_cannot_be_reached_is_refused_at_its_first_epoch(kind):
    """Refused at the first epoch's draw, at construction (``prepare``, which every process reaches), never at a
    ``len(dl)`` that one process alone may make."""
    match = r"sampler \w+ draws a different order each time for the same epoch.*Keep the sampler's RNG in such an attribute"
    if kind == "shard":
        dl = DataLoader(list(range(N)), batch_size=3, sampler=Unreachable(N))
        with pytest.raises(UnsupportedConfigError, match=match):
            ShardDataLoader.from_dataloader(dl, DistContext(), data_seed=7)
    else:
        dl = DataLoader(list(range(N)), batch_sampler=BatchSampler(Unreachable(N), 4, drop_last=False))
        with pytest.raises(UnsupportedConfigError, match=match):
            BatchSamplerDataLoader.from_dataloader(dl, DistContext(), data_seed=7)
