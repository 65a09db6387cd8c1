"""Exact resume of iterable datasets (shard mode) and of the dispatcher, on ranks simulated in one process."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
from torch.utils.data import DataLoader

from accelerate_stateful import (
    DispatchDataLoader,
    DistContext,
    IterableShardDataLoader,
    UnsupportedConfigError,
)

from harness import check_resumes, run_loop, save_points
from streams import CountingStream, HeavyStateStream, OpaqueStream, read_log

EPOCHS = 3


def chains_for(reference, workers=0):
    """Every save point without workers; with worker processes (slow to start) a representative few."""
    points = save_points(reference)
    if workers:
        ends = [p for p in points if p[1] == "after_loop"]
        middle = points[len(points) // 2]
        return [[points[1]], [ends[0]], [middle], sorted({points[2], ends[-1], points[-2]})]
    return [[p] for p in points] + [sorted(points[1::3]), sorted(points[::4])[:3]]


def shard_factory(n, batch_size, world, rank, *, workers=0, drop_last=False, split=False, stream=CountingStream):
    def make():
        dl = DataLoader(stream(n), batch_size=batch_size, num_workers=workers, drop_last=drop_last)
        return IterableShardDataLoader.from_dataloader(dl, DistContext(rank, world), split_batches=split)

    return make


def dispatch_factory(n, batch_size, world, rank, *, workers=0, drop_last=False, split=False, iterable=True):
    def make():
        dataset = CountingStream(n) if iterable else list(range(n))
        dl = DataLoader(dataset, batch_size=batch_size, num_workers=workers, drop_last=drop_last)
        return DispatchDataLoader.from_dataloader(dl, DistContext(rank, world), split_batches=split)

    return make


def _matrix(workers_options):
    for world, workers, drop, split in itertools.product([1, 2, 3], workers_options, [False, True], [False, True]):
        yield pytest.param(world, workers, drop, split, id=f"w{world}-workers{workers}-{'drop' if drop else 'keep'}"
                           + ("-split" if split else ""))


@pytest.mark.parametrize("world,workers,drop,split", list(_matrix([0, 2])))
def test_iterable_shard_resumes_exactly_at_every_save_point(world, workers, drop, split):
    batch = 2 * world if split else 2
    for rank in sorted({0, world - 1}):
        make = shard_factory(23, batch, world, rank, workers=workers, drop_last=drop, split=split)
        reference, _ = run_loop(make(), EPOCHS)
        check_resumes(make, EPOCHS, chains_for(reference, workers), reference, rank)


def _dispatch_matrix():
    # A map-style reader's workers hold no position (the shard loader's tests cover them), so only streams
    # are run with workers here.
    for iterable in (True, False):
        for param in _matrix([0, 2] if iterable else [0]):
            yield pytest.param(*param.values, iterable, id=f"{'iterable' if iterable else 'map'}-{param.id}")


@pytest.mark.parametrize("world,workers,drop,split,iterable", list(_dispatch_matrix()))
def test_dispatcher_resumes_exactly_at_every_save_point(world, workers, drop, split, iterable):
    batch = 3 * world if split else 3
    for rank in sorted({0, world - 1}):
        make = dispatch_factory(23, batch, world, rank, workers=workers, drop_last=drop, split=split,
                                iterable=iterable)
        reference, _ = run_loop(make(), EPOCHS)
        check_resumes(make, EPOCHS, chains_for(reference, workers), reference, rank)


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent-workers"])
def test_a_stream_with_three_workers_resumes_exactly_in_every_worker_rotation(persistent):
    def make():
        dl = DataLoader(CountingStream(31), batch_size=2, num_workers=3, persistent_workers=persistent)
        return IterableShardDataLoader.from_dataloader(dl, DistContext(0, 1))

    reference, _ = run_loop(make(), 2)
    first_epoch = sum(1 for s in reference if s.epoch == 0)
    chains = [[(k, "in_loop")] for k in range(1, first_epoch)] + [[(3, "in_loop"), (7, "in_loop"), (20, "in_loop")]]
    check_resumes(make, 2, chains, reference)


def test_dispatched_slices_of_all_ranks_make_up_the_global_batches():
    world = 3
    per_rank = [run_loop(dispatch_factory(23, 3, world, r, iterable=False)(), 1)[0] for r in range(world)]
    delivered = [i for step in zip(*per_rank) for s in step for i in s.ids]
    assert delivered[:23] == list(range(23))
    assert delivered[23:] == [0]  # the last step of 5 samples is completed with the epoch's first sample


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_stream_resumes_without_reading_what_it_does_not_deliver(tmp_path, workers):
    def make(log_dir=None):
        dl = DataLoader(CountingStream(40, log_dir), batch_size=4, num_workers=workers)
        return IterableShardDataLoader.from_dataloader(dl, DistContext(0, 1))

    first = make()
    it = iter(first)
    for _ in range(5):
        next(it)
    state = first.state_dict()
    del it
    resumed = make(tmp_path)
    resumed.load_state_dict(state)
    delivered = [i for batch in resumed for i in batch.tolist()]
    assert read_log(tmp_path) == sorted(delivered)
    assert len(delivered) == 40 - 5 * 4


def test_an_opaque_stream_is_fast_forwarded_with_one_warning_and_a_replay_count(caplog):
    make = shard_factory(23, 2, 1, 0, stream=OpaqueStream)
    reference, _ = run_loop(make(), EPOCHS)
    seen, state = run_loop(make(), EPOCHS, stop=(4, "in_loop"))
    resumed = make()
    with caplog.at_level(logging.WARNING, logger="accelerate_stateful"):
        resumed.load_state_dict(state)
    assert resumed.replayed_samples == 8
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "OpaqueStream" in warnings[0] and "8 samples" in warnings[0]
    assert seen + run_loop(resumed, EPOCHS, taken=4)[0] == reference


def test_a_changed_worker_count_is_accepted_for_a_stream():
    state = shard_factory(23, 2, 1, 0, workers=2)().state_dict()
    shard_factory(23, 2, 1, 0, workers=0)().load_state_dict(state)  # test_stream_workers_elastic.py: what it delivers


def test_a_changed_world_size_is_accepted_for_a_stream_every_rank_reads_whole():
    state = shard_factory(23, 2, 2, 0)().state_dict()
    shard_factory(23, 2, 3, 0)().load_state_dict(state)  # test_replicated_elastic.py checks what it delivers


def test_in_order_false_is_refused_for_a_stream_with_workers():
    dl = DataLoader(CountingStream(8), batch_size=2, num_workers=2, in_order=False)
    with pytest.raises(UnsupportedConfigError, match="in_order=True"):
        IterableShardDataLoader.from_dataloader(dl, DistContext(0, 1))


def test_skipping_batches_of_a_stream_is_refused_with_the_alternative():
    with pytest.raises(UnsupportedConfigError, match="cannot move an iterable dataset without reading"):
        shard_factory(23, 2, 1, 0)().seek(2)


def test_a_stream_state_is_complete_before_the_first_batch():
    loader = shard_factory(23, 2, 2, 1, workers=2)()
    before = loader.state_dict()
    it = iter(loader)
    next(it)
    assert set(before) == set(loader.state_dict())
    assert set(before["stream"]) == set(loader.state_dict()["stream"])


@pytest.mark.parametrize("live", [True, False], ids=["live-state", "fresh-state"])
@pytest.mark.parametrize("world,workers", [(1, 0), (1, 2), (2, 2)])
def test_a_large_state_with_tensors_resumes_exactly_and_never_blocks_a_worker(live, world, workers):
    # 800 KB per state, more than a pipe holds: a worker whose stream ends sends its ring while the main
    # process waits for it; a state returned by reference changes under it after the batch.
    def factory(rank, stream):
        def make():
            dl = DataLoader(stream(23), batch_size=2, num_workers=workers)
            return IterableShardDataLoader.from_dataloader(dl, DistContext(rank, world))

        return make

    for rank in sorted({0, world - 1}):
        make = factory(rank, lambda n: HeavyStateStream(n, live))
        reference, _ = run_loop(make(), 2)
        assert reference == run_loop(factory(rank, CountingStream)(), 2)[0]  # the same ids as a light state
        check_resumes(make, 2, chains_for(reference, workers), reference, rank)


def test_a_state_is_copied_only_when_state_dict_returns_parts_that_change_later():
    from accelerate_stateful.loaders._snapshot import shares_mutable_parts as shares

    buffer, tensor = [1, 2], torch.arange(4)
    assert shares({"b": buffer}, {"b": buffer})
    assert not shares({"b": list(buffer)}, {"b": list(buffer)})
    assert shares({"t": tensor}, {"t": tensor[1:]})  # a view of the same memory
    assert not shares({"t": tensor.clone()}, {"t": tensor.clone()})
    assert shares({"nested": ({"b": buffer},)}, {"nested": ({"b": buffer},)})
    assert not shares({"pos": 3, "name": "x", "t": (1, 2)}, {"pos": 3, "name": "x", "t": (1, 2)})


class _EpochRecorder(CountingStream):
    """A stream with an ``epoch`` attribute whose ``set_epoch`` must run for every epoch, the first included."""

    calls: list = []

    def set_epoch(self, epoch: int) -> None:
        _EpochRecorder.calls.append(epoch)
        super().set_epoch(epoch)


@pytest.mark.parametrize("workers", [0, 2])
def test_set_epoch_is_called_for_every_epoch_even_when_the_dataset_already_reports_it(workers):
    _EpochRecorder.calls = []
    dl = DataLoader(_EpochRecorder(8), batch_size=2, num_workers=workers)
    loader = IterableShardDataLoader.from_dataloader(dl, DistContext(0, 1))
    for _ in range(2):
        list(loader)
    assert [0, 1] == sorted(set(_EpochRecorder.calls)) and _EpochRecorder.calls[0] == 0
