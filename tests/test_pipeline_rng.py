"""Randomness drawn in the data pipeline and in user samplers, reproduced after a resume (ranks simulated in-process).

Datasets here draw from the ``torch``, ``random`` and ``numpy`` global RNGs (or from ``sample_rng``) in
``__getitem__``; every drawn value is an exact integer, so "identical" means equal.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, RandomSampler, Sampler, get_worker_info

from accelerate_stateful import (
    Accelerator,
    BatchSamplerDataLoader,
    DispatchDataLoader,
    DistContext,
    IterableShardDataLoader,
    LifecycleError,
    SampleRNG,
    ShardDataLoader,
    UnsupportedConfigError,
    sample_rng,
)
from accelerate_stateful.training._rng import sample_seed
from harness import through_files

SAMPLES, BATCH, SEED = 23, 3, 11


def draw_globals() -> int:
    return int(torch.randint(1 << 20, ())) + random.randrange(1 << 20) + int(np.random.randint(1 << 20))


def draw_sample(rng: SampleRNG) -> int:
    return int(torch.randint(1 << 20, (), generator=rng.torch)) + rng.random.randrange(1 << 20) + int(
        rng.numpy.randint(1 << 20))


class GlobalDraws(Dataset):
    """Sample ``i`` is ``[i, a draw from the three global RNGs]``."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, draw_globals()])


class SampleDraws(GlobalDraws):
    """Sample ``i`` is ``[i, a draw from sample_rng(i)]``."""

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, draw_sample(sample_rng(index))])


class BatchedDraws(GlobalDraws):
    """Fetches whole batches (``__getitems__``), drawing from the global RNGs."""

    def __getitems__(self, indices: list) -> list:
        return [torch.tensor([i, draw_globals()]) for i in indices]


class WholeBatchDraws(GlobalDraws):
    """Given each batch's index list whole (a batch sampler passed as ``sampler=``), drawing per sample."""

    def __getitem__(self, indices: list) -> torch.Tensor:
        return torch.stack([GlobalDraws.__getitem__(self, i) for i in indices])


def loader(dataset, ctx=DistContext(0, 1), workers=0, mode="auto", kind="shard", **kw):
    """The shard loader over a shuffled ``DataLoader``; ``kind="batch_sampler"``: the loader over a user's
    ``batch_sampler``, ``"as_sampler"``: one passed as ``sampler=`` (the dataset gets whole index lists)."""
    if kind == "shard":
        base = DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=workers,
                          generator=torch.Generator().manual_seed(SEED), **kw)
        return ShardDataLoader.from_dataloader(base, ctx, pipeline_rng=mode)
    batches = BatchSampler(RandomSampler(range(SAMPLES), generator=torch.Generator().manual_seed(SEED)), BATCH, False)
    if kind == "as_sampler":
        base = DataLoader(WholeBatchDraws(), sampler=batches, batch_size=None, num_workers=workers, **kw)
    else:
        base = DataLoader(dataset, batch_sampler=batches, num_workers=workers, **kw)
    return BatchSamplerDataLoader.from_dataloader(base, ctx, pipeline_rng=mode)


def epochs(dl, count=2, stop=None, saved=None) -> list[list[list[int]]]:
    """The batches of ``count`` epochs from the loader's position; ``stop=(epoch, batches)`` ends early, after
    appending the loader's state (taken inside the loop, while the pass is live) to ``saved``."""
    seen = []
    for epoch in range(dl.epoch, count):
        for batch in dl:
            seen.append([epoch, batch.tolist()])
            if stop == (epoch, dl.batches_yielded):
                if saved is not None:
                    saved.append(through_files(dl.state_dict()))
                return seen
    return seen


def resumed(make, stop) -> list:
    """The uninterrupted run's batches and those of a run stopped at ``stop`` and resumed in a fresh loader."""
    first, saved = make(), []
    before = epochs(first, stop=stop, saved=saved)
    state = saved[0]
    torch.manual_seed(999), random.seed(999), np.random.seed(999)  # another process: other global RNG states
    second = make()
    second.load_state_dict(state)
    return before + epochs(second)


# workers=0 with "auto" adds nothing: there the draws are the main process's own RNG stream, which
# Accelerate's load_state restores (test_bitwise.py covers it end to end).
# A dataset given whole batches cannot be seeded per sample: refused (test_an_unknown_mode_and_per_sample_...).
@pytest.mark.parametrize("kind,workers,mode", [
    (kind, workers, mode) for kind in ("shard", "batch_sampler", "as_sampler")
    for workers, mode in [(2, "auto"), (0, "batch"), (2, "batch"), (0, "sample"), (2, "sample")]
    if not (kind == "as_sampler" and mode == "sample")], ids=lambda v: str(v))
@pytest.mark.parametrize("stop", [(0, 2), (0, 7), (1, 1)], ids=["early", "last-batch", "next-epoch"])
def test_global_draws_in_getitem_are_reproduced_after_a_mid_epoch_resume(kind, workers, mode, stop):
    uninterrupted = epochs(loader(GlobalDraws(), workers=workers, mode=mode, kind=kind))
    assert resumed(lambda: loader(GlobalDraws(), workers=workers, mode=mode, kind=kind), stop) == uninterrupted


def test_without_seeding_workers_restart_their_rng_and_a_resume_draws_other_values():
    """The opt-out keeps torch's behaviour, which is the failure the default mode removes."""
    make = lambda: loader(GlobalDraws(), workers=2, mode="off")  # noqa: E731
    assert resumed(make, (0, 3)) != epochs(make())


def test_batch_mode_draws_the_same_values_with_and_without_workers_and_leaves_the_main_rng_alone():
    torch.manual_seed(5)
    before = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    in_main = epochs(loader(GlobalDraws(), workers=0, mode="batch"))
    after = torch.get_rng_state(), random.getstate(), np.random.get_state()[1]
    assert torch.equal(before[0], after[0]) and before[1] == after[1] and (before[2] == after[2]).all()
    assert in_main == epochs(loader(GlobalDraws(), workers=2, mode="batch"))


def values(batches: list) -> dict[tuple[int, int], int]:
    return {(epoch, sample): drawn for epoch, batch in batches for sample, drawn in batch}


@pytest.mark.parametrize("dataset,mode", [(GlobalDraws, "sample"), (SampleDraws, "auto"), (SampleDraws, "off")],
                         ids=["global-draws-sample-mode", "sample_rng-auto", "sample_rng-off"])
def test_per_sample_draws_do_not_depend_on_world_size_workers_or_an_elastic_resume(dataset, mode):
    expected = {(e, i): draw_sample(SampleRNG(sample_seed(SEED, e, i))) for e in range(2) for i in range(SAMPLES)}
    for world in (1, 2, 3):
        got = {}
        for rank in range(world):
            got.update(values(epochs(loader(dataset(), DistContext(rank, world), mode=mode))))
        assert got == expected, f"world {world}"
    # Elastic: 2 ranks stop mid-epoch, 3 ranks (one with workers) take the rest of it and the next epoch.
    old = [loader(dataset(), DistContext(r, 2), mode=mode) for r in range(2)]
    got, saved = {}, []
    for dl in old:
        got.update(values(epochs(dl, stop=(0, 2), saved=saved)))
    state = saved[0]
    for rank in range(3):
        dl = loader(dataset(), DistContext(rank, 3), workers=2 if rank == 1 else 0, mode=mode)
        dl.load_state_dict(state)
        got.update(values(epochs(dl)))
    assert got == expected


def test_sample_rng_needs_a_loader_fetch_or_explicit_seed_and_epoch():
    with pytest.raises(LifecycleError, match=r"outside a stateful loader's fetch.*pass seed=\.\.\. and epoch=\.\.\."):
        sample_rng(3)
    assert sample_rng(3, seed=SEED, epoch=1).seed == sample_seed(SEED, 1, 3)


def test_sample_rng_as_a_context_seeds_the_global_rngs_and_restores_them():
    state = torch.get_rng_state()
    with sample_rng(4, seed=1, epoch=0):
        inside = torch.randint(1 << 20, ())
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(inside, torch.randint(1 << 20, (), generator=sample_rng(4, seed=1, epoch=0).torch))


def test_an_unknown_mode_and_per_sample_seeding_of_a_batched_dataset_are_refused():
    with pytest.raises(UnsupportedConfigError, match=r"pipeline_rng='always' is not a mode; pass one of 'auto'"):
        Accelerator(cpu=True, pipeline_rng="always")
    with pytest.raises(UnsupportedConfigError, match=r"pipeline_rng='always' is not a mode; pass one of 'auto'"):
        loader(GlobalDraws(), mode="always")
    with pytest.raises(UnsupportedConfigError, match=r"BatchedDraws fetches whole batches with __getitems__; use "
                                                     r"pipeline_rng='batch', or sample_rng"):
        loader(BatchedDraws(), mode="sample")
    with pytest.raises(UnsupportedConfigError, match=r"WholeBatchDraws is given whole batches by its sampler; use "
                                                     r"pipeline_rng='batch', or sample_rng"):
        loader(GlobalDraws(), mode="sample", kind="as_sampler")


def test_a_dataset_fetching_whole_batches_is_reproduced_per_batch_with_workers():
    make = lambda: loader(BatchedDraws(), workers=2, mode="auto")  # noqa: E731
    assert resumed(make, (0, 4)) == epochs(make())


# --------------------------------------------------------------------------- user samplers (issue 9, item 3)
class NumpyShuffle(Sampler[int]):
    """Shuffles with numpy's global RNG each epoch (after ``set_seed`` in the user's script)."""

    def __len__(self) -> int:
        return SAMPLES

    def __iter__(self):
        return iter(np.random.permutation(SAMPLES).tolist())


class RandomShuffle(NumpyShuffle):
    """Shuffles with Python's ``random``."""

    def __iter__(self):
        order = list(range(SAMPLES))
        random.shuffle(order)
        return iter(order)


@pytest.mark.parametrize("sampler", [NumpyShuffle, RandomShuffle], ids=["numpy", "random"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_sampler_shuffling_with_numpy_or_random_resumes_exactly_and_leaves_the_global_rngs_alone(sampler, world):
    def make(rank):
        base = DataLoader(list(range(SAMPLES)), batch_size=BATCH, sampler=sampler())
        return ShardDataLoader.from_dataloader(base, DistContext(rank, world), data_seed=SEED)

    for rank in range(world):
        np.random.seed(1), random.seed(1)
        uninterrupted = epochs(make(rank), count=3)
        state = np.random.get_state()[1].copy(), random.getstate()
        assert (np.random.get_state()[1] == np.random.RandomState(1).get_state()[1]).all() and state[1] == (
            random.Random(1).getstate())
        first = make(rank)
        held = []
        before = epochs(first, count=3, stop=(1, 2), saved=held)
        saved = held[0]
        np.random.seed(77), random.seed(77)  # a new process after a resume: the global RNGs are elsewhere
        second = make(rank)
        second.load_state_dict(saved)
        assert before + epochs(second, count=3) == uninterrupted
    assert uninterrupted[0] != uninterrupted[len(uninterrupted) // 3]  # epochs are shuffled differently


class WorkerShuffled(IterableDataset):
    """An opaque stream each worker shuffles with an RNG seeded from ``torch.initial_seed()`` (a common recipe),
    adding a numpy draw to each item."""

    def __iter__(self):
        info = get_worker_info()
        ids = list(range(info.id, SAMPLES, info.num_workers))
        random.Random(torch.initial_seed()).shuffle(ids)
        return iter([torch.tensor([i, int(np.random.randint(1 << 20))]) for i in ids])


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent-workers"])
@pytest.mark.parametrize("stop", [(0, 1), (0, 2), (1, 3)], ids=["after-worker0", "after-worker1", "next-epoch"])
def test_a_per_worker_shuffle_seeded_from_torch_initial_seed_resumes_exactly(stop, persistent):
    def make():
        base = DataLoader(WorkerShuffled(), batch_size=BATCH, num_workers=2, persistent_workers=persistent)
        return IterableShardDataLoader.from_dataloader(base, DistContext(0, 1), data_seed=SEED)

    uninterrupted = epochs(make(), count=3)
    assert uninterrupted[:len(uninterrupted) // 3] != uninterrupted[len(uninterrupted) // 3:2 * len(uninterrupted) // 3]
    first, before = make(), []
    for epoch in range(stop[0] + 1):
        live = iter(first)  # kept alive while the state is taken, as in a training loop
        for batch in live:
            before.append([epoch, batch.tolist()])
            if (epoch, first.batches_yielded) == stop:
                break
    state = through_files(first.state_dict())
    del live
    second = make()
    second.load_state_dict(state)
    assert before + epochs(second, count=3) == uninterrupted


@pytest.mark.parametrize("workers", [0, 2], ids=["workers0", "workers2"])
def test_the_dispatchers_reader_reads_ahead_so_its_fetches_are_seeded_per_batch(workers):
    def make():
        base = DataLoader(GlobalDraws(), batch_size=BATCH, shuffle=True, num_workers=workers,
                          generator=torch.Generator().manual_seed(SEED))
        return DispatchDataLoader.from_dataloader(base, DistContext(0, 1))

    torch.manual_seed(0)
    uninterrupted = epochs(make())
    first, before = make(), []
    live = iter(first)
    for batch in itertools.islice(live, 3):
        before.append([0, batch.tolist()])
    state = through_files(first.state_dict())
    torch.manual_seed(0)  # as Accelerate's load_state restores the process's RNG state saved with the checkpoint
    del live
    second = make()
    second.load_state_dict(state)
    assert before + epochs(second) == uninterrupted
