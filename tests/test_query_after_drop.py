"""A query's answer does not depend on whether the loop's iterator object is still alive.

A pass the loop let go (``break``, an exception, ``del it``) waits for its verdict until the loader's next event
(``docs/lifecycle.md``); until then ``state_dict()``, ``batches_yielded`` and ``epoch`` report the live pass,
whose position the DataLoader workers hold. Checked for every loader kind, with 1 to 3 workers, at drawn steps:
the answers after the iterator died (and the garbage collector ran) are those taken while it was held, and the
next ``iter()`` then takes the verdict (an untrained pass is undone) and ends the workers.
"""

from __future__ import annotations

import gc
import json
import random

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from accelerate_stateful import (BatchSamplerDataLoader, DispatchDataLoader, DistContext, IterableShardDataLoader,
                                 Mixture, ShardDataLoader)


def _loader(kind: str, workers: int):
    if kind == "shard":
        return ShardDataLoader.from_dataloader(
            DataLoader(TensorDataset(torch.arange(40)), batch_size=3, shuffle=True, num_workers=workers,
                       generator=torch.Generator().manual_seed(1)), DistContext(0, 1))
    if kind == "batch_sampler":
        sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(40)), 3, False)
        return BatchSamplerDataLoader.from_dataloader(
            DataLoader(TensorDataset(torch.arange(40)), batch_sampler=sampler, num_workers=workers), DistContext(0, 1))
    mix = Mixture({"a": list(range(60)), "b": list(range(1000, 1060))}, {"a": 1, "b": 2}, seed=3)
    build = DispatchDataLoader if kind == "dispatch" else IterableShardDataLoader
    return build.from_dataloader(DataLoader(mix, batch_size=3, num_workers=workers), DistContext(0, 1))


def _answers(loader) -> str:
    return json.dumps([loader.epoch, loader.batches_yielded, repr(loader.phase), loader.state_dict()],
                      sort_keys=True, default=repr)


def _cases() -> list:
    rng = random.Random(1128)
    return [pytest.param(kind, workers, rng.randrange(1, 8), id=f"{kind}-workers{workers}")
            for kind in ("shard", "batch_sampler", "stream", "dispatch") for workers in (1, 2, 3)]


@pytest.mark.parametrize("kind,workers,stop", _cases())
def test_the_answers_after_the_iterator_died_are_those_while_it_was_held(kind, workers, stop, monkeypatch):
    monkeypatch.setenv("ACCELERATE_STATEFUL_REPLY_TIMEOUT", "20")  # a dead worker fails in seconds, not minutes
    loader = _loader(kind, workers)
    it = iter(loader)
    for _ in range(stop):
        next(it)
    held = _answers(loader)
    del it
    gc.collect()
    assert _answers(loader) == held
    iter(loader)  # the next event: the pass, let go untrained, is undone
    assert loader.batches_yielded == 0
