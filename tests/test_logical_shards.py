"""Logical shards: a stream resumed on another number of ranks and workers, every part from its own position.

(This file was tests/test_sharded.py until that name went to the FSDP2 check, which replaced its content by
mistake in f85f4dc; restored here.)
"""

from __future__ import annotations

import itertools

import pytest
from torch.utils.data import DataLoader

from accelerate_stateful import DispatchDataLoader, DistContext, IterableShardDataLoader, TextLines
from accelerate_stateful.sources.sharded import LogicalShardStream

from harness import check_resumes, run_loop, save_points, through_files

EPOCHS = 2
LINES_PER_FILE = [9, 4, 13, 1, 7, 11, 6]  # 51 lines in 7 parts of uneven length


@pytest.fixture
def corpus(tmp_path):
    paths, next_id = [], 0
    for index, count in enumerate(LINES_PER_FILE):
        path = tmp_path / f"part{index}.txt"
        path.write_text("".join(f"{next_id + i}\n" for i in range(count)))
        paths.append(path)
        next_id += count
    return paths


def collate_ids(lines):
    import torch

    return torch.tensor([int(line) for line in lines])


def shard_loader(paths, world, rank, workers, batch_size=2):
    dl = DataLoader(TextLines(paths), batch_size=batch_size, num_workers=workers, collate_fn=collate_ids)
    return IterableShardDataLoader.from_dataloader(dl, DistContext(rank, world))


def ids(batches):
    return [i for b in batches for i in b.tolist()]


def test_a_sharded_source_is_read_as_logical_shards(corpus):
    loader = shard_loader(corpus, 1, 0, 0)
    assert isinstance(loader.unwrap().dataset.dataset, LogicalShardStream) and loader.elastic
    assert sorted(ids(loader)) == list(range(51))


@pytest.mark.parametrize("world,workers", [(1, 0), (1, 2), (2, 0), (3, 2)])
def test_logical_shards_resume_exactly_on_the_same_topology(corpus, world, workers):
    for rank in range(world):
        make = lambda: shard_loader(corpus, world, rank, workers)  # noqa: E731
        reference, _ = run_loop(make(), EPOCHS)
        points = save_points(reference)
        chains = [[p] for p in points] if not workers else [[points[1]], [points[len(points) // 2]]]
        check_resumes(make, EPOCHS, chains + [sorted(points[1::3])], reference, rank)


def _rescales():
    topologies = [(1, 0), (1, 2), (2, 0), (2, 1), (3, 0), (3, 2)]
    for before, after in itertools.product(topologies, repeat=2):
        if before != after:
            yield pytest.param(before, after, id=f"{before[0]}x{before[1]}-to-{after[0]}x{after[1]}")


@pytest.mark.parametrize("before,after", list(_rescales()))
def test_a_rescale_delivers_every_remaining_line_once_and_later_epochs_of_a_fresh_run(corpus, before, after):
    (world, workers), (new_world, new_workers) = before, after
    for steps in (1, 4):
        taken, states = [], []
        for rank in range(world):
            loader = shard_loader(corpus, world, rank, workers)
            it = iter(loader)
            taken += ids([next(it) for _ in range(steps)])
            states.append(through_files(loader.state_dict(), rank))
            del it
        resumed = [shard_loader(corpus, new_world, r, new_workers) for r in range(new_world)]
        for loader in resumed:
            state = loader.merge_rank_states(states) if loader.needs_all_ranks(states[0]) else states[0]
            loader.load_state_dict(state)
        rest = [ids(loader) for loader in resumed]
        delivered = [i for part in rest for i in part]
        assert sorted(taken + delivered) == list(range(51)), f"after {steps} steps"
        fresh = [shard_loader(corpus, new_world, r, new_workers) for r in range(new_world)]
        for loader in fresh:
            loader.set_epoch(1)
        assert [[b.tolist() for b in loader] for loader in resumed] == [[b.tolist() for b in f] for f in fresh]


@pytest.mark.parametrize("after", [(1, 0), (2, 0), (3, 0)])
def test_a_resume_reads_no_line_it_does_not_deliver(corpus, monkeypatch, after):
    read = []
    original = TextLines.open_shard

    def counting(self, index, position):
        reader = original(self, index, position)
        advance = reader.__next__

        def next_line():
            line = advance()
            read.append(int(line))
            return line

        reader.__next__ = next_line
        return _Iter(reader, next_line)

    first = shard_loader(corpus, 1, 0, 0)
    it = iter(first)
    taken = ids([next(it) for _ in range(5)])
    state = through_files(first.state_dict())
    del it
    monkeypatch.setattr(TextLines, "open_shard", counting)
    resumed = [shard_loader(corpus, after[0], r, after[1]) for r in range(after[0])]
    for loader in resumed:
        loader.load_state_dict(state)
    rest = [i for loader in resumed for i in ids(loader)]
    assert sorted(read) == sorted(rest) and sorted(taken + rest) == list(range(51))


class _Iter:
    """A reader whose ``next`` is counted."""

    def __init__(self, reader, next_line):
        self._reader, self._next = reader, next_line

    def __iter__(self):
        return self

    def __next__(self):
        return self._next()

    def position(self):
        return self._reader.position()


@pytest.mark.parametrize("workers,new_workers", [(2, 0), (0, 2), (2, 3)])
def test_the_dispatchers_reader_may_change_its_worker_count(corpus, workers, new_workers):
    def make(w):
        dl = DataLoader(TextLines(corpus), batch_size=2, num_workers=w, collate_fn=collate_ids)
        return DispatchDataLoader.from_dataloader(dl, DistContext(0, 1))

    first = make(workers)
    it = iter(first)
    taken = ids([next(it) for _ in range(6)])
    state = through_files(first.state_dict())
    del it
    resumed = make(new_workers)
    resumed.load_state_dict(state)
    assert sorted(taken + ids(resumed)) == list(range(51))


def test_hugging_face_shards_rescale_from_their_own_positions():
    import datasets
    from accelerate_stateful import HFShards

    source = datasets.Dataset.from_dict({"id": list(range(40))}).to_iterable_dataset(num_shards=5)

    def make(world, rank, workers):
        dl = DataLoader(HFShards(source), batch_size=3, num_workers=workers)
        return IterableShardDataLoader.from_dataloader(dl, DistContext(rank, world))

    taken, states = [], []
    for rank in range(2):
        loader = make(2, rank, 0)
        it = iter(loader)
        taken += [i for b in [next(it) for _ in range(2)] for i in b["id"].tolist()]
        states.append(through_files(loader.state_dict(), rank))
        del it
    resumed = [make(3, r, 0) for r in range(3)]
    for loader in resumed:
        loader.load_state_dict(loader.merge_rank_states(states))
    rest = [i for loader in resumed for b in loader for i in b["id"].tolist()]
    assert sorted(taken + rest) == list(range(40))
