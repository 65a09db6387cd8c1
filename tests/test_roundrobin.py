"""A non-replicable source: read in one place, transformed in the workers round-robin, resumed exactly."""

from __future__ import annotations

import logging

import pytest
from torch.utils.data import DataLoader

from accelerate_stateful import (
    DispatchDataLoader,
    DistContext,
    RoundRobinDataset,
    RoundRobinLoader,
    UnsupportedConfigError,
)

from harness import check_resumes, run_loop, save_points
from streams import OpenOnce, decode

EPOCHS = 3


def make_factory(n=23, batch_size=3, workers=0, world=1, rank=0, drop_last=False, source=None):
    def make():
        dataset = RoundRobinDataset(source() if source else OpenOnce(n), transform=decode)
        dl = DataLoader(dataset, batch_size=batch_size, num_workers=workers, drop_last=drop_last)
        if world == 1:
            return RoundRobinLoader.from_dataloader(dl, DistContext(0, 1))
        return DispatchDataLoader.from_dataloader(dl, DistContext(rank, world))

    return make


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("drop_last", [False, True])
def test_a_round_robin_source_resumes_exactly_at_every_save_point(workers, drop_last):
    make = make_factory(workers=workers, drop_last=drop_last)
    reference, _ = run_loop(make(), EPOCHS)
    points = save_points(reference)
    chains = [[p] for p in points] if not workers else [[points[1]], [points[len(points) // 2]], [points[-3]]]
    chains.append(sorted({points[1], points[len(points) // 2], points[-2]}))
    check_resumes(make, EPOCHS, chains, reference)


@pytest.mark.parametrize("world,rank", [(2, 0), (2, 1), (3, 2)])
def test_on_several_ranks_the_source_is_dispatched_and_resumes_exactly(world, rank):
    make = make_factory(world=world, rank=rank)
    reference, _ = run_loop(make(), EPOCHS)
    points = save_points(reference)
    check_resumes(make, EPOCHS, [[p] for p in points] + [sorted(points[1::3])], reference, rank)


# The dispatcher reads two steps of world_size batches before the loop takes the first, and the base
# loader's workers prefetch on top: the source position of every batch read must be kept until taken.
@pytest.mark.parametrize("world,workers", [(3, 2), (4, 0), (4, 2), (6, 0)])
def test_the_dispatcher_may_read_a_round_robin_source_two_steps_ahead(world, workers):
    make = make_factory(n=60, workers=workers, world=world)
    reference, _ = run_loop(make(), 2)
    points = save_points(reference)
    check_resumes(make, 2, [[points[1]], [points[len(points) // 2]], [points[-2]]], reference)


def test_batches_go_to_the_workers_round_robin_in_read_order():
    loader = make_factory(n=24, workers=3)()
    batches = list(loader)
    assert [b["id"].tolist() for b in batches] == [[i, i + 1, i + 2] for i in range(0, 24, 3)]
    assert [set(b["worker"].tolist()) for b in batches] == [{k % 3} for k in range(8)]


def test_the_worker_count_may_change_on_resume():
    reference, _ = run_loop(make_factory(workers=2)(), EPOCHS)
    seen, state = run_loop(make_factory(workers=2)(), EPOCHS, stop=(4, "in_loop"))
    resumed = make_factory(workers=0)()
    resumed.load_state_dict(state)
    assert seen + run_loop(resumed, EPOCHS, taken=4)[0] == reference


def test_a_source_given_as_a_factory_is_reopened_and_fast_forwarded_with_a_warning(caplog):
    def opener():
        return lambda: iter(range(20))

    make = make_factory(source=opener)
    reference, _ = run_loop(make(), 2)
    seen, state = run_loop(make(), 2, stop=(3, "in_loop"))
    resumed = make()
    with caplog.at_level(logging.WARNING, logger="accelerate_stateful"):
        resumed.load_state_dict(state)
    assert resumed.replayed_samples == 9
    assert "reads and drops the 9 items" in caplog.text
    assert seen + run_loop(resumed, 2, taken=3)[0] == reference


def test_a_source_that_can_neither_report_nor_reopen_is_refused():
    with pytest.raises(UnsupportedConfigError, match="state_dict\\(\\)/load_state_dict\\(\\) or be a callable"):
        RoundRobinDataset(iter(range(3)))


def test_shard_mode_on_several_processes_is_refused_because_the_source_would_be_replicated():
    dl = DataLoader(RoundRobinDataset(OpenOnce(5)), batch_size=2)
    with pytest.raises(UnsupportedConfigError, match="read in one place.*dispatch_batches=True"):
        RoundRobinLoader.from_dataloader(dl, DistContext(0, 2))


def test_a_plain_dataloader_with_workers_replicates_the_source_and_it_fails_loudly():
    dl = DataLoader(RoundRobinDataset(OpenOnce(5), transform=decode), batch_size=2, num_workers=2)
    with pytest.raises(RuntimeError, match="opened inside a worker"):
        list(dl)
