"""A user's ``worker_init_fn`` sees the user's dataset in every loader: torch's IterableDataset sharding recipe.

The recipe (torch's ``IterableDataset`` docstring) narrows each worker's copy of the dataset to its share of a
range in ``worker_init_fn``, through ``get_worker_info().dataset``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from accelerate_stateful import (
    DispatchDataLoader, DistContext, IterableShardDataLoader, RoundRobinDataset, RoundRobinLoader, ShardDataLoader,
)

from harness import check_resumes, run_loop, save_points

EPOCHS = 2


class RangeStream(IterableDataset):
    def __init__(self, start, end):
        self.start, self.end = start, end

    def __iter__(self):
        return iter(range(self.start, self.end))


def split_range(worker_id):
    """torch's recipe, as its documentation writes it."""
    worker_info = get_worker_info()
    dataset = worker_info.dataset  # the dataset copy in this worker process
    overall_start, overall_end = dataset.start, dataset.end
    per_worker = int(math.ceil((overall_end - overall_start) / float(worker_info.num_workers)))
    worker_id = worker_info.id
    dataset.start = overall_start + worker_id * per_worker
    dataset.end = min(dataset.start + per_worker, overall_end)


def recipe_loader(persistent=False):
    return DataLoader(RangeStream(3, 20), batch_size=2, num_workers=2, worker_init_fn=split_range,
                      persistent_workers=persistent)


def ids(loader):
    return [b.tolist() for b in loader]


def test_the_default_dispatcher_runs_the_recipe_as_torch_and_accelerate_do():
    plain = ids(recipe_loader())  # Accelerate's dispatcher on one process yields the torch loader's batches
    ours = DispatchDataLoader.from_dataloader(recipe_loader(), DistContext(0, 1))
    assert ids(ours) == plain
    assert sorted(i for b in plain for i in b) == list(range(3, 20))


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
@pytest.mark.parametrize("kind", ["dispatch", "iterable-shard"])
def test_the_recipe_resumes_exactly_at_every_save_point(kind, persistent):
    def make():
        if kind == "dispatch":
            return DispatchDataLoader.from_dataloader(recipe_loader(persistent), DistContext(0, 1))
        return IterableShardDataLoader.from_dataloader(recipe_loader(persistent), DistContext(1, 2))

    reference, _ = run_loop(make(), EPOCHS)
    points = save_points(reference)
    check_resumes(make, EPOCHS, [[points[2]], [points[3], points[len(points) // 2]]], reference,
                  rank=0 if kind == "dispatch" else 1)


def record_worker(worker_id):
    info = get_worker_info()
    torch.save((worker_id, info.id, type(info.dataset).__name__), f"{info.dataset.log}/{worker_id}.pt")


class Logged(torch.utils.data.Dataset):
    def __init__(self, log):
        self.log = log

    def __len__(self):
        return 6

    def __getitem__(self, i):
        return i


class LoggedSource:
    def __init__(self, log):
        self.log = log

    def __call__(self):
        return iter(range(6))


@pytest.mark.parametrize("kind", ["shard", "round-robin"])
def test_every_loader_calls_the_users_function_once_per_worker_with_the_users_dataset(kind, tmp_path):
    if kind == "shard":
        dl = ShardDataLoader.from_dataloader(
            DataLoader(Logged(tmp_path), batch_size=2, num_workers=2, worker_init_fn=record_worker), DistContext(0, 1))
        expected = "Logged"
    else:
        dataset = RoundRobinDataset(LoggedSource(tmp_path))
        dataset.log = tmp_path
        dl = RoundRobinLoader.from_dataloader(
            DataLoader(dataset, batch_size=2, num_workers=2, worker_init_fn=record_worker), DistContext(0, 1))
        expected = "RoundRobinDataset"
    assert sorted(i for b in dl for i in b.tolist()) == list(range(6))
    assert sorted(torch.load(p) for p in tmp_path.glob("*.pt")) == [(0, 0, expected), (1, 1, expected)]
