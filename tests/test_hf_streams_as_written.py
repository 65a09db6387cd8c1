"""🤗 ``datasets`` streams as users write them, handed straight to the DataLoader, resume exactly (issue 26).

``ds.shuffle(seed=..., buffer_size=...).map(tokenize)``, alone, filtered, cut with ``skip``/``take`` or
through ``interleave_datasets``: the loader recognises the shuffle buffer at prepare and reads the dataset
with each buffer replayed exactly (``sources/_hf_streams``). Ranks are simulated in one process (no
real multi-process launch covers these pipelines yet).
"""

from __future__ import annotations


import pytest
import torch
from torch.utils.data import DataLoader

from accelerate_stateful import DispatchDataLoader, DistContext, IterableShardDataLoader
from accelerate_stateful.errors import CheckpointError, UnsupportedConfigError

from harness import check_resumes, epoch_end_counts, run_loop, save_points, through_files

import datasets  # noqa: E402 - make test installs it; a missing one fails, never skips

N = 23  # never a multiple of the batch size
EPOCHS = 2


pytestmark = pytest.mark.usefixtures("quiet_datasets")  # tests/conftest.py


def tokenize(example):
    return {"id": example["id"], "tokens": [example["id"]] * 2}


def keep(example):
    return example["id"] % 3 != 0


def _examples(n, start=0):
    for i in range(start, start + n):
        yield {"id": i}


def arrow(shards=4, start=0):
    return datasets.Dataset.from_dict({"id": list(range(start, start + N))}).to_iterable_dataset(num_shards=shards)


def table_filter():
    """The pipeline ``ds.filter(keep)`` builds over Arrow data before datasets 5.2 (datasets#8359): the filter's
    formatter reads whole tables, so its own state points past the table it is reading."""
    ds = arrow(shards=1).filter(keep)
    formatted = ds._ex_iterable.ex_iterable
    assert type(formatted.ex_iterable).__name__ == "RebatchedArrowExamplesIterable"  # 5.2's fix, taken out
    formatted.ex_iterable = formatted.ex_iterable.ex_iterable
    return ds


PIPELINES = {
    "shuffle-map": lambda: arrow().shuffle(seed=3, buffer_size=6).map(tokenize),
    "generator-shuffle-map": lambda: datasets.IterableDataset.from_generator(_examples, gen_kwargs={"n": N})
    .shuffle(seed=3, buffer_size=6).map(tokenize),
    "shuffle-filter": lambda: arrow().shuffle(seed=3, buffer_size=6).filter(keep),
    "filter-shuffle": lambda: arrow().filter(keep).shuffle(seed=3, buffer_size=6),
    "shuffle-batched-map": lambda: arrow().shuffle(seed=3, buffer_size=6).map(
        lambda b: {"id": b["id"]}, batched=True, batch_size=4),
    "shuffle-skip-take": lambda: arrow().shuffle(seed=3, buffer_size=6).skip(2).take(17),
    "interleave": lambda: datasets.interleave_datasets(
        [arrow().shuffle(seed=3, buffer_size=6).map(tokenize),
         arrow(shards=2, start=100).shuffle(seed=4, buffer_size=5).map(tokenize)],
        probabilities=[0.6, 0.4], seed=7),
    "interleave-cycling": lambda: datasets.interleave_datasets(
        [arrow().shuffle(seed=3, buffer_size=6), arrow(shards=2, start=100).shuffle(seed=4, buffer_size=5)]),
    "torch-format": lambda: arrow().shuffle(seed=3, buffer_size=6).map(tokenize).with_format("torch"),
    "table-filter": table_filter,
}
# (processes, dispatched) simulated in one process
TOPOLOGIES = [(1, False), (2, False), (3, False), (2, True)]


def factory(pipeline, world, rank, *, dispatch=False, workers=0):
    def make():
        dl = DataLoader(PIPELINES[pipeline](), batch_size=2, num_workers=workers)
        return (DispatchDataLoader if dispatch else IterableShardDataLoader).from_dataloader(dl, DistContext(rank, world))

    return make


def ids_of_epoch(steps, epoch):
    return [i for s in steps if s.epoch == epoch for i in s.ids]


@pytest.mark.parametrize("pipeline", sorted(PIPELINES))
def test_a_stream_as_written_resumes_exactly_at_every_save_point(pipeline):
    make = factory(pipeline, 1, 0)
    reference, _ = run_loop(make(), EPOCHS)
    chains = [[p] for p in save_points(reference)] + [[(1, "in_loop"), (2, "in_loop"), (3, "in_loop")]]
    check_resumes(make, EPOCHS, chains, reference)


@pytest.mark.parametrize("world,dispatch", TOPOLOGIES[1:], ids=[f"{w}p-{'dispatch' if d else 'shard'}"
                                                                for w, d in TOPOLOGIES[1:]])
@pytest.mark.parametrize("pipeline", ["shuffle-map", "interleave", "shuffle-filter"])
def test_a_stream_as_written_resumes_exactly_on_every_simulated_rank(pipeline, world, dispatch):
    for rank in sorted({0, world - 1}):
        make = factory(pipeline, world, rank, dispatch=dispatch)
        reference, _ = run_loop(make(), EPOCHS)
        end = epoch_end_counts(reference)[0]
        chains = [[(1, "in_loop")], [(end // 2, "in_loop"), (end, "after_loop")], [(end + 1, "in_loop")]]
        check_resumes(make, EPOCHS, chains, reference, rank)


@pytest.mark.parametrize("pipeline,dispatch", [("shuffle-map", False), ("interleave", False),
                                               ("shuffle-filter", True)])
def test_a_stream_as_written_read_by_two_workers_resumes_exactly(pipeline, dispatch):
    make = factory(pipeline, 1, 0, dispatch=dispatch, workers=2)
    reference, _ = run_loop(make(), EPOCHS)
    end = epoch_end_counts(reference)[0]
    check_resumes(make, EPOCHS, [[(end // 2, "in_loop")], [(1, "in_loop"), (3, "in_loop")],
                                 [(end, "after_loop"), (end + 1, "in_loop")]], reference)


@pytest.mark.parametrize("pipeline", ["shuffle-map", "generator-shuffle-map", "interleave", "shuffle-filter",
                                      "shuffle-skip-take"])
def test_one_process_delivers_datasets_own_order_in_every_epoch(pipeline):
    steps, _ = run_loop(factory(pipeline, 1, 0)(), EPOCHS)
    for epoch in range(EPOCHS):
        stock = PIPELINES[pipeline]()
        stock.set_epoch(epoch)
        assert ids_of_epoch(steps, epoch) == [example["id"] for example in stock]
    assert ids_of_epoch(steps, 0) != ids_of_epoch(steps, 1)


def test_a_table_reading_filter_loses_rows_on_its_own_state_and_none_through_the_loader():
    """datasets#8359, pinned on the pipeline older releases build: its own state skips the rest of a table."""
    ds = table_filter()
    it = iter(ds)
    first = [next(it)["id"] for _ in range(3)]
    state = ds.state_dict()
    again = table_filter()
    again.load_state_dict(state)
    assert [x["id"] for x in again] == []  # the one table's other rows are gone
    assert first == [1, 2, 4]
    make = factory("table-filter", 1, 0)
    reference, _ = run_loop(make(), EPOCHS)
    assert ids_of_epoch(reference, 0) == [i for i in range(N) if keep({"id": i})]
    check_resumes(make, EPOCHS, [[(2, "in_loop")], [(5, "in_loop")]], reference)


def test_a_shuffle_without_a_seed_is_refused_at_the_first_batch_after_the_load_with_the_fix():
    def make():
        ds = arrow().shuffle(buffer_size=6).map(tokenize)  # a new order in every process
        return IterableShardDataLoader.from_dataloader(DataLoader(ds, batch_size=2), DistContext(0, 1))

    _, state = run_loop(make(), EPOCHS, (3, "in_loop"))
    resumed = make()
    resumed.load_state_dict(through_files(state))
    with pytest.raises(CheckpointError, match=r"draws another order.*seed=\.\.\. to shuffle\(\)"):
        next(iter(resumed))


def test_a_shuffled_stream_split_by_node_is_refused_at_prepare_with_the_fix():
    from datasets.distributed import split_dataset_by_node

    ds = split_dataset_by_node(arrow().shuffle(seed=3, buffer_size=6), rank=0, world_size=2)
    with pytest.raises(UnsupportedConfigError, match=r"pass the dataset without split_dataset_by_node\(\)"):
        IterableShardDataLoader.from_dataloader(DataLoader(ds, batch_size=2), DistContext(0, 2))


def test_a_stream_without_shuffle_buffer_or_table_filter_is_read_through_its_own_state():
    loader = factory("shuffle-map", 1, 0)()
    assert type(loader.dataset).__name__ == "HFStream"
    plain = IterableShardDataLoader.from_dataloader(DataLoader(arrow().map(tokenize), batch_size=2),
                                                    DistContext(0, 1))
    assert isinstance(plain.dataset, datasets.IterableDataset)
    assert torch.is_tensor(next(iter(plain))["id"])
