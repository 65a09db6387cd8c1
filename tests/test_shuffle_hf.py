"""exact_shuffle: a shuffled datasets.IterableDataset in stock order, item for item, resumed exactly.

Tiny local files with several shards (never a download): JSON lines and parquet read in tables, a
generator and a mapped dataset read example by example, which are the two ways datasets feeds its buffer.
"""

from __future__ import annotations

import itertools
import json

import datasets
import pytest
import torch
from torch.utils.data import DataLoader

from accelerate_stateful import DistContext, IterableShardDataLoader
from accelerate_stateful.errors import UnsupportedConfigError
from accelerate_stateful.sources.packed import Packed
from accelerate_stateful.sources.shuffle import Shuffled, exact_shuffle

from harness import run_loop, through_files


def shard_rows(shard):
    return [{"id": shard * 1000 + i, "text": "x" * (i % 4)} for i in range(17 + 6 * shard)]


def generate(shards):
    for shard in shards:
        yield from ({"id": row["id"]} for row in shard_rows(shard))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path_factory.mktemp("shards")
    jsons, parquets = [], []
    for shard in range(4):
        rows = shard_rows(shard)
        jsons.append(folder / f"part{shard}.jsonl")
        jsons[-1].write_text("".join(json.dumps(row) + "\n" for row in rows))
        parquets.append(str(folder / f"part{shard}.parquet"))
        pq.write_table(pa.Table.from_pylist(rows), parquets[-1], row_group_size=5)
    streaming = lambda kind, files: datasets.load_dataset(  # noqa: E731
        kind, data_files=[str(f) for f in files], split="train", streaming=True)
    return {
        "json-tables": lambda: streaming("json", jsons),
        "parquet-tables": lambda: streaming("parquet", parquets),
        "generator-examples": lambda: datasets.IterableDataset.from_generator(
            generate, gen_kwargs={"shards": [0, 1, 2, 3]}),
        "mapped-examples": lambda: streaming("json", jsons).map(lambda row: {"double": 2 * row["id"]}),
    }


@pytest.fixture(autouse=True)
def no_sleep_at_thread_shutdown(monkeypatch):
    """datasets (5.x) sleeps 5 s when an iterator over parquet shards is dropped; abandoned cursors would wait.
    Older releases have no such sleep (and no setting for it)."""
    monkeypatch.setattr(datasets.config, "SLEEP_TIME_ON_THREADS_SHUTDOWN", 0, raising=False)


def cuts(n, size):
    return sorted({0, 1, size // 2, size, size + 1, n // 3, n // 2, n - size, n - 1, n} & set(range(n + 1)))


@pytest.mark.parametrize("kind", ["json-tables", "parquet-tables", "generator-examples", "mapped-examples"])
@pytest.mark.parametrize("size", [1, 5, 16])
def test_items_and_order_are_stock_iterations_in_each_epoch_and_a_resume_continues_them(sources, kind, size):
    shuffled = sources[kind]().shuffle(seed=11, buffer_size=size)
    for epoch in (0, 1):
        shuffled.set_epoch(epoch)
        stock = list(shuffled)
        stream = exact_shuffle(shuffled)
        stream.set_epoch(epoch)
        assert list(stream) == stock, f"epoch {epoch}"
        for cut in cuts(len(stock), size):
            first = exact_shuffle(shuffled)
            first.set_epoch(epoch)
            head = list(itertools.islice(iter(first), cut))
            again = exact_shuffle(shuffled)
            again.set_epoch(epoch)
            again.load_state_dict(json.loads(json.dumps(first.state_dict())))
            assert head + list(again) == stock, f"epoch {epoch}, cut after item {cut}"


def test_the_position_holds_read_numbers_and_a_bounded_stretch_to_read_again(sources):
    shuffled = sources["json-tables"]().shuffle(seed=3, buffer_size=8)
    stream = exact_shuffle(shuffled)
    list(itertools.islice(iter(stream), 60))
    position = stream.state_dict()["position"]
    assert all(type(n) is int for n in position["rows"]) and 8 <= len(position["rows"]) < 8 + 20
    assert position["from_read"] <= min(position["rows"]) and max(position["rows"]) < position["read"]
    assert position["read"] - position["from_read"] < 60


@pytest.mark.parametrize("kind", ["json-tables", "generator-examples"])
def test_the_packages_own_buffer_over_an_unshuffled_stream_resumes_at_every_sampled_cut(sources, kind):
    """Shuffled reads a datasets.IterableDataset through its own state_dict(): positions to read again from."""
    stream = sources[kind]()
    make = lambda: Shuffled(stream, 12, seed=4)  # noqa: E731
    whole = list(make())
    assert sorted(row["id"] for row in whole) == sorted(row["id"] for row in stream)
    for cut in cuts(len(whole), 12):
        first = make()
        head = list(itertools.islice(iter(first), cut))
        again = make()
        again.load_state_dict(json.loads(json.dumps(first.state_dict())))
        assert head + list(again) == whole, f"cut after item {cut}"


def test_packed_reads_a_map_style_dataset_in_index_order():
    table = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [], [4, 5, 6, 7, 8]], "text": ["a", "", "b"]})
    rows = [row["input_ids"].tolist() for row in Packed(table, seq_len=4)]
    assert rows == [[1, 2, 3, 4], [5, 6, 7, 8]]


def rows_to_ids(rows):
    return {"id": torch.tensor([hash(tuple(r["input_ids"].tolist())) & 0xFFFFFFF for r in rows])}


def test_packed_over_it_in_two_workers_resumes_on_three(sources):
    shuffled = sources["json-tables"]().map(lambda row: {"input_ids": [row["id"]] * (1 + row["id"] % 5)})
    shuffled = shuffled.shuffle(seed=5, buffer_size=10)

    def make(workers):
        dl = DataLoader(Packed(exact_shuffle(shuffled), seq_len=4), batch_size=3, num_workers=workers,
                        collate_fn=rows_to_ids)
        return IterableShardDataLoader.from_dataloader(dl, DistContext(0, 1))

    whole, _ = run_loop(make(2), 1)
    head, state = run_loop(make(2), 1, (7, "in_loop"))
    loader = make(3)
    loader.load_state_dict(through_files(state))
    rest, _ = run_loop(loader, 1, taken=len(head))
    assert head + rest == whole
    rows = rows_to_ids(list(Packed(exact_shuffle(shuffled), seq_len=4)))["id"].tolist()
    assert sorted(i for step in whole for i in step.ids) == sorted(rows)


def test_a_dataset_it_cannot_reproduce_is_refused_with_the_fix(sources):
    plain = sources["json-tables"]()
    with pytest.raises(UnsupportedConfigError, match=r"last step is .shuffle\(buffer_size=...\).*before shuffle\(\)"):
        exact_shuffle(plain.shuffle(seed=1).map(lambda row: row))
    with pytest.raises(UnsupportedConfigError, match=r"without with_format\(\)"):
        exact_shuffle(plain.shuffle(seed=1).with_format("torch"))
    with pytest.raises(UnsupportedConfigError, match=r"got a list"):
        exact_shuffle([1, 2])


def test_a_datasets_release_whose_buffer_it_does_not_replay_is_refused():
    """datasets 4.x drew one index per item from its buffer; exact_shuffle replays the rounds of 5.x and must
    refuse the other algorithm rather than resume it inexactly (it did, on datasets 4.7)."""
    from datasets.iterable_dataset import BufferShuffledExamplesIterable

    from accelerate_stateful.sources._shuffle_hf import plays_rounds

    class PerItemBuffer:  # the shape of datasets 4.7's BufferShuffledExamplesIterable.__iter__
        def __iter__(self):
            indices = self._iter_random_indices(None, 4)
            yield next(indices)

    assert plays_rounds(BufferShuffledExamplesIterable) and not plays_rounds(PerItemBuffer)
