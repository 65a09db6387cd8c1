"""A checkpoint taken right after an epoch's last batch resumes between that epoch and the next, for every
loader variant over the samplers users bring (issue 25, item 11 reported a loader over a user's
``batch_sampler`` resuming there as epoch 0 with epoch 1's batches; this in-process matrix passes on the
previous release too, so it guards the rule under the lifecycle change rather than reproducing that report).

The loop is the README's (``for epoch in range(dl.epoch, EPOCHS)``): the resumed loop re-enters the finished
epoch (its empty rest, so the code after the inner loop runs once for it), then reads the next epochs: its
epochs, batches and ``end_of_dataloader`` flags are the uninterrupted run's, with no epoch run twice or lost,
whatever the sampler and the number of workers.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

from accelerate_stateful import DistContext
from accelerate_stateful.loaders.batchsampler import BatchSamplerDataLoader
from accelerate_stateful.loaders.shard import ShardDataLoader

EPOCHS = 3


class PerEpoch(BatchSampler):
    """A batch sampler whose order follows ``set_epoch``."""

    def __init__(self, n: int, size: int) -> None:
        super().__init__(SequentialSampler(range(n)), size, False)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(len(self.sampler), generator=torch.Generator().manual_seed(100 + self.epoch))
        for start in range(0, len(order), self.batch_size):
            yield order[start:start + self.batch_size].tolist()


def fixed(n):
    return BatchSampler(SequentialSampler(range(n)), 3, False)


def generator(n):
    return BatchSampler(RandomSampler(range(n), generator=torch.Generator().manual_seed(4)), 3, False)


def per_epoch(n):
    return PerEpoch(n, 3)


def make(kind: str, rank: int, world: int, workers: int):
    data = list(range(14))
    if kind == "shard":
        dl = DataLoader(data, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(2),
                        num_workers=workers)
        return ShardDataLoader.from_dataloader(dl, DistContext(rank, world))
    sampler = {"fixed": fixed, "generator": generator, "per-epoch": per_epoch}[kind](len(data))
    dl = DataLoader(data, batch_sampler=sampler, num_workers=workers)
    return BatchSamplerDataLoader.from_dataloader(dl, DistContext(rank, world))


def run(loader, log, stop_at=None):
    """The README's loop; returns the state saved inside the loop after ``stop_at`` batches (or None)."""
    for epoch in range(loader.epoch, EPOCHS):
        for batch in loader:
            log.append((epoch, batch.tolist(), loader.end_of_dataloader))
            if stop_at is not None and len(log) == stop_at:
                return loader.state_dict()
        log.append(("after", epoch))
    return None


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("kind", ["shard", "fixed", "generator", "per-epoch"])
def test_a_save_after_an_epochs_last_batch_resumes_with_every_epoch_and_batch_once(kind, world, workers):
    for rank in range(world):
        reference = []
        run(make(kind, rank, world, 0), reference)
        ends = [i + 1 for i, entry in enumerate(reference) if entry[0] != "after" and entry[2]]
        assert len(ends) == EPOCHS
        for end in ends[:-1]:
            log = []
            state = run(make(kind, rank, world, workers), log, stop_at=end)
            resumed = make(kind, rank, world, workers)
            resumed.load_state_dict(state)
            rest = []
            run(resumed, rest)
            assert log + rest == reference, f"rank {rank}, saved after {end} batches"
