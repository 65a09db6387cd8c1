"""Hugging Face ``datasets``, map-style and iterable, through every loader variant, on ranks simulated in one process.

What holds (exact resume at every save point, later epochs included) is asserted as in the conformance
tests. Where ``datasets`` itself cannot restore a position (a shuffle buffer), the tests pin down exactly
what a resume delivers instead, so that ``docs/sources/hf-datasets.md`` can say it.
"""

from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from accelerate_stateful import (
    Accelerator,
    DispatchDataLoader,
    DistContext,
    HFShards,
    IterableShardDataLoader,
    ShardDataLoader,
)

from harness import check_resumes, epoch_end_counts, run_loop, save_points, through_files

import datasets  # noqa: E402 - make test installs it; a missing one fails, never skips

N = 23  # never a multiple of the batch sizes below
BUFFER = 6  # shuffle buffer of the iterable tests: a few batches deep
EPOCHS = 2


pytestmark = pytest.mark.usefixtures("quiet_datasets")  # tests/conftest.py


# ----------------------------------------------------------------------------- sources
def map_dataset(order: str, fmt: str, text: bool = True):
    """Ids 0..N-1 with a float column (and a string one: the dispatcher can only concatenate tensors)."""
    columns = {"id": list(range(N)), "x": [float(i) for i in range(N)]}
    if text:
        columns["text"] = [f"sample {i}" for i in range(N)]
    ds = datasets.Dataset.from_dict(columns)
    if order == "pre-shuffled":
        ds = ds.shuffle(seed=5)
    return ds.with_format("torch") if fmt == "torch" else ds


def _examples(n):
    for i in range(n):
        yield {"id": i}


def stream(kind: str, buffer: int = 0, n: int = N):
    """A ``datasets.IterableDataset``: ``generator`` (one shard) or ``arrow-<k>`` (``to_iterable_dataset(k)``)."""
    if kind == "generator":
        ds = datasets.IterableDataset.from_generator(_examples, gen_kwargs={"n": n})
    else:
        ds = datasets.Dataset.from_dict({"id": list(range(n))}).to_iterable_dataset(num_shards=int(kind[6:]))
    return ds.shuffle(seed=3, buffer_size=buffer) if buffer else ds


class Replayed(IterableDataset):
    """A ``datasets`` stream without ``state_dict()``: the loader resumes it by fast-forwarding (the workaround)."""

    def __init__(self, ds) -> None:
        self.ds = ds

    def set_epoch(self, epoch: int) -> None:
        self.ds.set_epoch(epoch)

    def __iter__(self):
        return iter(self.ds)


# ----------------------------------------------------------------------------- loaders
def map_factory(order, fmt, world, rank, *, workers=0, dispatch=False, batch_size=3):
    def make():
        kwargs = {"shuffle": True, "generator": torch.Generator().manual_seed(11)} if order == "loader-shuffle" else {}
        dl = DataLoader(map_dataset(order, fmt, text=not dispatch), batch_size=batch_size, num_workers=workers,
                        **kwargs)
        variant = DispatchDataLoader if dispatch else ShardDataLoader
        return variant.from_dataloader(dl, DistContext(rank, world))

    return make


def stream_factory(kind, world, rank, *, buffer=0, workers=0, dispatch=False, wrap=False, batch_size=2):
    def make():
        ds = stream(kind, buffer)
        dl = DataLoader(Replayed(ds) if wrap else ds, batch_size=batch_size, num_workers=workers)
        variant = DispatchDataLoader if dispatch else IterableShardDataLoader
        return variant.from_dataloader(dl, DistContext(rank, world))

    return make


WITHIN_FIRST_EPOCH = [(1, "in_loop"), (2, "in_loop"), (3, "in_loop")]  # three successive resumes in one epoch


def chains_for(reference, workers=0):
    """Every save point without workers; with worker processes (slow to start) a representative few."""
    points = save_points(reference)
    end = epoch_end_counts(reference)[0]
    if workers:
        return [[(end // 2, "in_loop")], WITHIN_FIRST_EPOCH, [(end, "after_loop"), (end + 1, "in_loop")]]
    return [[p] for p in points] + [WITHIN_FIRST_EPOCH, sorted(points[1::3]), sorted(points[::4])[:3]]


def ranks(world):
    return sorted({0, world - 1})


def epoch_ids(steps, epoch):
    return [i for s in steps if s.epoch == epoch for i in s.ids]


# ----------------------------------------------------------------------------- map-style
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("order", ["loader-shuffle", "pre-shuffled"])
@pytest.mark.parametrize("fmt", ["python", "torch"])
def test_a_map_style_dataset_resumes_exactly_at_every_save_point(fmt, order, world):
    for rank in ranks(world):
        make = map_factory(order, fmt, world, rank)
        reference, _ = run_loop(make(), 3)
        check_resumes(make, 3, chains_for(reference), reference, rank)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("order", ["loader-shuffle", "pre-shuffled"])
@pytest.mark.parametrize("fmt", ["python", "torch"])
def test_a_dispatched_map_style_dataset_resumes_exactly_at_every_save_point(fmt, order, world):
    for rank in ranks(world):
        make = map_factory(order, fmt, world, rank, dispatch=True)
        reference, _ = run_loop(make(), 3)
        check_resumes(make, 3, chains_for(reference), reference, rank)


@pytest.mark.parametrize(
    "order,fmt,world,dispatch",
    [
        pytest.param("loader-shuffle", "torch", 1, False, id="shard-w1"),
        pytest.param("pre-shuffled", "python", 2, False, id="shard-w2-pre-shuffled"),
        pytest.param("loader-shuffle", "torch", 3, False, id="shard-w3"),
        pytest.param("loader-shuffle", "torch", 2, True, id="dispatch-w2"),
    ],
)
def test_a_map_style_dataset_with_two_workers_resumes_exactly_and_equals_the_run_without(order, fmt, world, dispatch):
    rank = world - 1
    reference, _ = run_loop(map_factory(order, fmt, world, rank, dispatch=dispatch)(), 3)
    make = map_factory(order, fmt, world, rank, workers=2, dispatch=dispatch)
    assert run_loop(make(), 3)[0] == reference
    check_resumes(make, 3, chains_for(reference, workers=2), reference, rank)


def test_loader_shuffle_draws_a_new_order_each_epoch_and_a_pre_shuffled_dataset_keeps_its_order():
    for order, differ in (("loader-shuffle", True), ("pre-shuffled", False)):
        steps, _ = run_loop(map_factory(order, "torch", 1, 0)(), 3)
        orders = [epoch_ids(steps, e) for e in range(3)]
        assert all(sorted(o) == list(range(N)) for o in orders)
        assert (orders[0] != orders[1] and orders[1] != orders[2]) is differ, order


def test_dispatching_a_string_column_fails_as_accelerates_dispatcher_does():
    dl = DataLoader(map_dataset("pre-shuffled", "torch", text=True), batch_size=3)
    loader = DispatchDataLoader.from_dataloader(dl, DistContext(0, 2))
    with pytest.raises(TypeError, match="Can only concatenate tensors"):  # accelerate.utils.concatenate's message
        next(iter(loader))


# ----------------------------------------------------------------------------- iterable, no shuffle buffer
_STREAM_MODES = [(False, 1), (False, 2), (False, 3), (True, 2), (True, 3)]


@pytest.mark.parametrize("dispatch,world", _STREAM_MODES, ids=[f"{'dispatch' if d else 'shard'}-w{w}"
                                                             for d, w in _STREAM_MODES])
@pytest.mark.parametrize("kind", ["generator", "arrow-1", "arrow-4"])
def test_an_iterable_dataset_resumes_exactly_at_every_save_point(kind, dispatch, world):
    for rank in ranks(world):
        make = stream_factory(kind, world, rank, dispatch=dispatch)
        reference, _ = run_loop(make(), EPOCHS)
        check_resumes(make, EPOCHS, chains_for(reference), reference, rank)


@pytest.mark.parametrize(
    "kind,world,dispatch",
    [
        pytest.param("arrow-4", 1, False, id="arrow-4-shard-w1"),
        pytest.param("arrow-4", 3, False, id="arrow-4-shard-w3"),  # ranks get 2, 1 and 1 shards
        pytest.param("arrow-1", 2, False, id="arrow-1-shard-w2-sliced"),
        pytest.param("arrow-4", 2, True, id="arrow-4-dispatch-w2"),
    ],
)
def test_an_iterable_dataset_with_two_workers_resumes_exactly(kind, world, dispatch):
    for rank in ranks(world):
        make = stream_factory(kind, world, rank, workers=2, dispatch=dispatch)
        reference, _ = run_loop(make(), EPOCHS)
        check_resumes(make, EPOCHS, chains_for(reference, workers=2), reference, rank)


@pytest.mark.parametrize("kind,workers", [("generator", 2), ("arrow-2", 3)])
def test_fewer_shards_than_workers_still_deliver_every_sample_once_and_resume_exactly(kind, workers):
    """``datasets`` gives the workers beyond ``n_shards`` nothing to read; they end at once."""
    make = stream_factory(kind, 1, 0, workers=workers)
    reference, _ = run_loop(make(), EPOCHS)
    for epoch in range(EPOCHS):
        assert sorted(epoch_ids(reference, epoch)) == list(range(N))
    check_resumes(make, EPOCHS, chains_for(reference, workers), reference)


@pytest.mark.parametrize(
    "kind,world,parts",
    [("arrow-4", 2, [2, 2]), ("arrow-4", 3, [2, 1, 1]), ("arrow-1", 2, None), ("generator", 3, None)],
)
def test_shard_mode_splits_a_stream_by_shard_when_every_rank_gets_one_and_slices_it_otherwise(kind, world, parts):
    loaders = [stream_factory(kind, world, r)() for r in range(world)]
    assert [dl.dataset.n_shards for dl in loaders] == (parts or [1] * world)
    delivered = [i for dl in loaders for batch in dl for i in batch["id"].tolist()]
    assert sorted(set(delivered)) == list(range(N))
    if parts:
        assert len(delivered) == N  # each rank reads its own shards: no padding, maybe unequal batch counts
    else:
        assert len(delivered) == -(-N // (2 * world)) * 2 * world  # each global batch sliced; the last padded


_PARITY = [("generator", BUFFER), ("arrow-4", 0), ("arrow-4", BUFFER)]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("kind,buffer", _PARITY, ids=[f"{k}-buffer{b}" for k, b in _PARITY])
def test_every_epoch_equals_accelerates_own_loader_which_calls_set_epoch(kind, buffer, world,
                                                                       fresh_accelerate_state):
    from accelerate.data_loader import prepare_data_loader

    for rank in range(world):
        theirs_dl = prepare_data_loader(DataLoader(stream(kind, buffer), batch_size=2), None, num_processes=world,
                                        process_index=rank, put_on_device=False, dispatch_batches=False)
        theirs = [[b["id"].tolist() for b in theirs_dl] for _ in range(3)]
        ours_dl = stream_factory(kind, world, rank, buffer=buffer)()
        ours = [[b["id"].tolist() for b in ours_dl] for _ in range(3)]
        assert ours == theirs
        if buffer:
            assert ours[0] != ours[1] != ours[2]


@pytest.mark.parametrize("kind,workers", [("generator", 0), ("arrow-4", 0), ("arrow-1", 2)])
def test_a_shuffled_stream_resumed_at_an_epoch_boundary_continues_exactly_and_later_epochs_reshuffle(kind, workers):
    make = stream_factory(kind, 1, 0, buffer=BUFFER, workers=workers)
    reference, _ = run_loop(make(), 3)
    assert epoch_ids(reference, 0) != epoch_ids(reference, 1) != epoch_ids(reference, 2)
    end = epoch_end_counts(reference)[0]
    boundaries = [[(0, "in_loop")], [(end, "in_loop")], [(end, "after_loop")], [(end, "in_loop"), (2 * end, "in_loop")]]
    check_resumes(make, 3, boundaries if not workers else boundaries[2:], reference)


# ----------------------------------------------------------------------------- the shuffle buffer
def resumed_at(make, epochs, k):
    """The steps of a run saved after batch ``k`` and resumed in a new loader, and of the part before."""
    seen, state = run_loop(make(), epochs, (k, "in_loop"))
    loader = make()
    loader.load_state_dict(through_files(state))
    rest, _ = run_loop(loader, epochs, taken=k)
    return seen, rest


@pytest.mark.parametrize("kind,batch_size,workers", [("generator", 2, 0), ("generator", 3, 0), ("arrow-1", 3, 0),
                                                     ("arrow-4", 3, 0), ("arrow-4", 2, 2)])
def test_a_resume_inside_a_shuffle_buffer_continues_exactly(kind, batch_size, workers):
    """``datasets``' own state leaves the buffer out (a generator stream loses what it held; an Arrow-backed one
    loses some and repeats others; 4 shards read by 2 workers fail with ``IndexError``): the loader reads the
    buffer exactly instead (``sources/_hf_streams``, ``tests/test_hf_streams_as_written.py``)."""
    make = stream_factory(kind, 1, 0, buffer=BUFFER, batch_size=batch_size, workers=workers)
    reference, _ = run_loop(make(), EPOCHS)
    end = epoch_end_counts(reference)[0]
    points = [[(k, "in_loop")] for k in range(1, end)] if not workers else [[(2, "in_loop")], [(end - 1, "in_loop")]]
    check_resumes(make, EPOCHS, points, reference)


def test_datasets_own_state_of_a_shuffled_multi_shard_stream_read_by_two_workers_fails_in_torchdata():
    """``datasets`` loads a worker's state into the whole pipeline before splitting it by worker; with a shuffle
    buffer over several shards the two differ in shape: torchdata's StatefulDataLoader fails."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    theirs = StatefulDataLoader(stream("arrow-4", BUFFER), batch_size=2, num_workers=2)
    it = iter(theirs)
    next(it), next(it)
    state = theirs.state_dict()
    del it
    again = StatefulDataLoader(stream("arrow-4", BUFFER), batch_size=2, num_workers=2)
    again.load_state_dict(state)
    with pytest.raises(IndexError, match="list index out of range"):
        next(iter(again))


@pytest.mark.parametrize(
    "kind,world,workers,dispatch",
    [
        pytest.param("generator", 1, 0, False, id="generator-w1"),
        pytest.param("arrow-4", 2, 0, False, id="arrow-4-shard-w2"),
        pytest.param("arrow-4", 2, 0, True, id="arrow-4-dispatch-w2"),
        pytest.param("arrow-4", 1, 2, False, id="arrow-4-w1-workers2"),
    ],
)
def test_a_shuffled_stream_without_state_dict_resumes_exactly_by_replaying(kind, world, workers, dispatch):
    """The workaround: hide ``state_dict()`` and the loader fast-forwards the (deterministic) shuffled stream."""
    for rank in ranks(world):
        make = stream_factory(kind, world, rank, buffer=BUFFER, workers=workers, dispatch=dispatch, wrap=True)
        reference, _ = run_loop(make(), EPOCHS)
        chains = chains_for(reference, workers) if workers else [[p] for p in save_points(reference)]
        check_resumes(make, EPOCHS, chains, reference, rank)
    _, state = run_loop(make(), EPOCHS, (3, "in_loop"))
    resumed = make()
    resumed.load_state_dict(state)
    assert (resumed.reader if dispatch else resumed).replayed_samples >= 3 * 2  # at least the 3 batches taken


# ----------------------------------------------------------------------------- upstream pitfalls, pinned
@pytest.mark.parametrize("kind", ["generator", "arrow-4"])
def test_datasets_state_keeps_advancing_after_each_load_state_dict(kind):
    """Older ``datasets`` kept reporting the loaded state after a resume, so a second resume went back."""
    delivered, state = [], None
    for take in (3, 4, 5, None):
        ds = stream(kind)
        if state is not None:
            ds.load_state_dict(state)
        items = iter(ds)
        delivered += [next(items)["id"] for _ in range(take)] if take else [x["id"] for x in items]
        state = ds.state_dict()
    assert delivered == list(range(N))


PRODUCED: list[int] = []  # what _logged_examples produced in this process


def _logged_examples(shards):
    for shard in shards:
        for i in range(10):
            PRODUCED.append(10 * shard + i)
            yield {"id": 10 * shard + i}


@pytest.mark.parametrize("taken,replayed", [(8, 8), (14, 4)])
def test_datasets_re_runs_the_current_generator_shard_up_to_the_position_on_resume(taken, replayed):
    """The loader reads nothing it does not deliver, but ``datasets`` resumes a generator shard by running it
    again from its start and dropping the examples before the position (earlier shards are skipped whole)."""

    def make():
        ds = datasets.IterableDataset.from_generator(_logged_examples, gen_kwargs={"shards": [0, 1, 2]})
        return IterableShardDataLoader.from_dataloader(DataLoader(ds, batch_size=2), DistContext(0, 1))

    _, state = run_loop(make(), 1, (taken // 2, "in_loop"))
    resumed = make()
    resumed.load_state_dict(through_files(state))
    PRODUCED.clear()
    delivered = [i for batch in resumed for i in batch["id"].tolist()]
    assert delivered == list(range(taken, 30))
    assert len(PRODUCED) - len(delivered) == replayed
    assert PRODUCED[:replayed] == list(range(taken - replayed, taken))


# ----------------------------------------------------------------------------- through the Accelerator
def test_the_accelerator_prepares_hf_datasets_and_resumes_them_from_a_checkpoint(tmp_path, fresh_accelerate_state):
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration

    def prepared():
        accelerator = Accelerator(
            cpu=True,
            dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
            project_config=ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True),
        )
        table = DataLoader(map_dataset("loader-shuffle", "torch"), batch_size=4, shuffle=True,
                           generator=torch.Generator().manual_seed(2))
        return accelerator, accelerator.prepare(table, DataLoader(stream("arrow-4"), batch_size=4))

    def ids(batches):
        return [b["id"].tolist() for b in batches]

    accelerator, (table, lines) = prepared()
    assert (type(table), type(lines)) == (ShardDataLoader, DispatchDataLoader)
    full = [ids(table) + ids(table), ids(lines) + ids(lines)]
    fresh_accelerate_state._reset_state(True)

    accelerator, (table, lines) = prepared()
    table_it, lines_it = iter(table), iter(lines)
    seen = [ids(next(table_it) for _ in range(4)), ids(next(lines_it) for _ in range(3))]
    accelerator.save_state()
    del table_it, lines_it
    fresh_accelerate_state._reset_state(True)

    accelerator, (table, lines) = prepared()
    assert accelerator.resume() is not None
    for got, loader in zip(seen, (table, lines)):
        for _ in range(loader.epoch, 2):
            got += ids(loader)
    assert seen == full


# ----------------------------------------------------------------------------- peeks, epochs, logical shards
@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataset_read_before_prepare_still_starts_at_its_first_example(workers):
    ds = stream("arrow-2")
    next(iter(ds))  # a peek at the data, as notebooks do
    dl = DataLoader(ds, batch_size=4, num_workers=workers)
    loader = IterableShardDataLoader.from_dataloader(dl, DistContext(0, 1))
    for _ in range(EPOCHS):
        assert sorted(i for batch in loader for i in batch["id"].tolist()) == list(range(N))


class _EpochProbe(IterableDataset):
    """A ``datasets`` stream whose ``set_epoch`` does what ``datasets`` does, ``_epoch += epoch - _epoch`` on a
    tensor that forked workers share, with the gap between the read and the write widened until every worker
    has read: the interleaving that occurs, rarely, when workers start together. Items carry the epoch that
    ``datasets`` iterates with."""

    def __init__(self, ds, workers: int, epochs: int) -> None:
        self.ds = ds
        self.barriers = [multiprocessing.get_context("fork").Barrier(workers) for _ in range(epochs)]

    def set_epoch(self, epoch: int) -> None:
        delta = epoch - self.ds.epoch
        try:
            self.barriers[epoch].wait(timeout=1)
        except threading.BrokenBarrierError:  # fewer callers than workers: nothing to interleave with
            pass
        self.ds.set_epoch(self.ds.epoch + delta)

    def state_dict(self):
        return self.ds.state_dict()

    def load_state_dict(self, state):
        self.ds.load_state_dict(state)

    def __iter__(self):
        epoch = self.ds.epoch
        for item in self.ds:
            yield {"id": item["id"], "epoch": epoch}


def test_every_worker_reads_the_epoch_the_loader_is_in():
    dl = DataLoader(_EpochProbe(stream("arrow-4"), workers=2, epochs=2), batch_size=2, num_workers=2)
    loader = IterableShardDataLoader.from_dataloader(dl, DistContext(0, 1))
    seen = {(epoch, read) for epoch in range(2) for batch in loader for read in batch["epoch"].tolist()}
    assert seen == {(0, 0), (1, 1)}  # (the loader's epoch, the epoch datasets read with)


def test_hf_shards_reshuffle_a_shuffled_stream_each_epoch():
    dl = DataLoader(HFShards(stream("arrow-4", BUFFER)), batch_size=N)
    loader = IterableShardDataLoader.from_dataloader(dl, DistContext(0, 1))
    epochs = [[i for batch in loader for i in batch["id"].tolist()] for _ in range(2)]
    assert epochs[0] != epochs[1]
