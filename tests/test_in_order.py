"""``DataLoader(in_order=False)``: refused with workers at ``prepare`` by every loader, accepted without workers."""

from __future__ import annotations

import pytest
import torch
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from accelerate_stateful import Accelerator, RoundRobinDataset, UnsupportedConfigError

from streams import CountingStream

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def dataloaders(workers):
    """One user loader per kind of prepared loader: shard, batch sampler, stream, round-robin, dispatched map."""
    data = list(range(10))
    yield "map-style", DataLoader(data, batch_size=2, num_workers=workers, in_order=False), None
    batches = BatchSampler(SequentialSampler(data), 3, False)
    yield "batch-sampler", DataLoader(data, batch_sampler=batches, num_workers=workers, in_order=False), None
    yield "stream", DataLoader(CountingStream(10), batch_size=2, num_workers=workers, in_order=False), False
    source = RoundRobinDataset(lambda: iter(range(10)))
    yield "round-robin", DataLoader(source, batch_size=2, num_workers=workers, in_order=False), False
    yield "dispatched map-style", DataLoader(data, batch_size=2, num_workers=workers, in_order=False), True


def prepare(dataloader, dispatch):
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True,
                                                                                  dispatch_batches=dispatch))
    return accelerator.prepare(dataloader)


@pytest.mark.parametrize("kind", ["map-style", "batch-sampler", "stream", "round-robin", "dispatched map-style"])
def test_in_order_false_with_workers_is_refused_at_prepare_with_the_reason_and_the_fix(kind):
    _, dataloader, dispatch = next(d for d in dataloaders(2) if d[0] == kind)
    with pytest.raises(UnsupportedConfigError, match=r"in_order=False\) with num_workers=2 .* in_order=True"):
        prepare(dataloader, dispatch)


@pytest.mark.parametrize("kind", ["map-style", "batch-sampler", "stream", "round-robin", "dispatched map-style"])
def test_in_order_false_without_workers_changes_nothing_and_is_accepted(kind):
    _, dataloader, dispatch = next(d for d in dataloaders(0) if d[0] == kind)
    ids = sorted(i for batch in prepare(dataloader, dispatch) for i in torch.as_tensor(batch).flatten().tolist())
    assert ids == list(range(10))
