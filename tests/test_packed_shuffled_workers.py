"""Packed and Shuffled read through a real DataLoader: killed, and resumed with another number of workers.

The sources are global sequences: each DataLoader worker reads the whole sequence and keeps its share
(items k % workers == w). Resumed with another worker count, the rest of the interrupted epoch is the
saved run's, batch for batch, and later epochs are a fresh run's (the loader's contract for streams,
tests/test_stream_workers_elastic.py); over the interrupted epoch every row comes exactly once.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DataLoader

from accelerate_stateful import DistContext, IterableShardDataLoader
from accelerate_stateful.sources.packed import Packed
from accelerate_stateful.sources.shuffle import Shuffled

from harness import run_loop, through_files

EPOCHS, BATCH = 2, 3
DOCS = [{"input_ids": list(range(100 * i, 100 * i + (i * 5) % 13))} for i in range(40)]  # lengths 0..12


def rows_as_ids(rows):
    """Collate: one batch id per row (the row's tokens), so a batch can be compared as a tuple."""
    return {"id": torch.tensor([hash(tuple(r["input_ids"].tolist())) & 0xFFFFFFF for r in rows])}


PIPELINES = {
    "packed-shuffled": (lambda: Packed(Shuffled(DOCS, 7, seed=3), seq_len=5, last="pad"), rows_as_ids),
    "shuffled-ints": (lambda: Shuffled(list(range(45)), 10, seed=5), None),
}


def make(pipeline, workers, world=1, rank=0):
    build, collate = PIPELINES[pipeline]
    dl = DataLoader(build(), batch_size=BATCH, num_workers=workers, collate_fn=collate)
    return IterableShardDataLoader.from_dataloader(dl, DistContext(rank, world))


def whole_epoch(pipeline, epoch):
    """The global sequence of one epoch, read in this process without a loader."""
    stream = PIPELINES[pipeline][0]()
    stream.set_epoch(epoch)
    items = list(stream)
    collate = PIPELINES[pipeline][1]
    return sorted(collate(items)["id"].tolist() if collate else items)


def ids_of(batch):
    return (batch["id"] if isinstance(batch, dict) else batch).tolist()


_RUNS: dict = {}


def uninterrupted(pipeline, workers):
    if (pipeline, workers) not in _RUNS:
        _RUNS[pipeline, workers] = run_loop(make(pipeline, workers), EPOCHS)[0]
    return _RUNS[pipeline, workers]


def resumed_run(pipeline, chain):
    """Run on ``chain[0][0]`` workers to batch ``chain[0][1]``, then resume on each next count in turn."""
    seen, state = [], None
    for (workers, stop), nxt in itertools.zip_longest(chain, chain[1:]):
        loader = make(pipeline, workers)
        if state is not None:
            loader.load_state_dict(through_files(state))
        steps, state = run_loop(loader, EPOCHS, (stop, "in_loop") if stop is not None else None, taken=len(seen))
        seen += steps
    return seen


CASES = [pytest.param(p, saved, now, where, id=f"{p}-L{saved}-W{now}-{where}")
         for p in PIPELINES for saved, now, where in [(0, 2, "mid"), (2, 3, "early"), (3, 1, "mid"),
                                                      (1, 0, "last"), (2, 2, "mid")]]


@pytest.mark.parametrize("pipeline,saved,now,where", CASES)
def test_a_resume_on_another_worker_count_continues_the_epoch_and_loses_or_repeats_nothing(
        pipeline, saved, now, where):
    length = sum(1 for s in uninterrupted(pipeline, saved) if s.epoch == 0)
    stop = {"early": 1, "mid": length // 2, "last": length}[where]
    seen = resumed_run(pipeline, [(saved, stop), (now, None)])
    first = [s for s in uninterrupted(pipeline, saved) if s.epoch == 0]
    assert seen == first + [s for s in uninterrupted(pipeline, now) if s.epoch > 0]
    for epoch in range(EPOCHS):
        ids = sorted(i for s in seen if s.epoch == epoch for i in s.ids)
        assert ids == whole_epoch(pipeline, epoch), f"epoch {epoch}: every row exactly once"


def test_a_chain_of_resumes_through_zero_one_two_and_three_workers():
    chain = [(3, 2), (0, 4), (2, 7), (1, None)]
    for pipeline in PIPELINES:
        seen = resumed_run(pipeline, chain)
        first = [s for s in uninterrupted(pipeline, 3) if s.epoch == 0]
        assert seen == first + [s for s in uninterrupted(pipeline, 1) if s.epoch > 0]


@pytest.mark.parametrize("pipeline,world,new_world,workers,new_workers", [
    ("packed-shuffled", 2, 3, 2, 0), ("shuffled-ints", 3, 1, 0, 2), ("packed-shuffled", 1, 2, 3, 1)])
def test_simulated_ranks_resumed_on_another_number_of_processes_deliver_every_unconsumed_row_once(
        pipeline, world, new_world, workers, new_workers):
    """Every rank reads the whole global sequence and slices its global batches; new ranks slice on from rank 0's
    state (tests/test_replicated_elastic.py)."""
    taken, states = [], []
    for rank in range(world):
        loader = make(pipeline, workers, world, rank)
        batches = iter(loader)
        taken += [i for _ in range(2) for i in ids_of(next(batches))]
        states.append(through_files(loader.state_dict(), rank))
        del batches
    rest = []
    for rank in range(new_world):
        loader = make(pipeline, new_workers, new_world, rank)
        loader.load_state_dict(states[0])
        for batch in loader:
            rest += ids_of(batch)
    epoch = whole_epoch(pipeline, 0)
    assert sorted(taken) == sorted(set(taken)) and set(taken) <= set(epoch)
    fresh = [i for i in rest if i not in set(taken)]
    assert sorted(set(fresh)) == sorted(set(epoch) - set(taken))
    # besides the padding that completes each (logical) worker's last global batch, every row comes once
    assert len(rest) - len(set(fresh)) < BATCH * new_world * max(workers, new_workers, 1)
