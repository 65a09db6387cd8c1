"""Without ``drop_last``, a stream read by every rank pads its last global batch with the pass's first items;
the saved state does not hold them (it would grow with the number of ranks), and a resumed pass reads them
again as its pass began (``loaders/_first_batch.py``). Ranks simulated in one process."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.data import DataLoader

from accelerate_stateful import DistContext, IterableShardDataLoader
from accelerate_stateful.checkpoint import _files

from harness import Step, assert_same_stream, batch_ids, through_files
from streams import CountingStream, OpaqueStream

BATCH, EPOCHS = 2, 2


def _noise() -> int:
    """A draw from the global ``torch`` and ``random`` RNGs, as an augmenting stream makes."""
    return int(torch.randint(1000, ())) * 1000 + random.randrange(1000)


class NoisyStream(CountingStream):
    """A stateful stream whose items carry draws from the global RNGs: a re-read must draw them again."""

    def __iter__(self):
        for item in super().__iter__():
            yield item * 10**6 + _noise()


class NoisyOpaqueStream(OpaqueStream):
    def __iter__(self):
        for item in super().__iter__():
            yield item * 10**6 + _noise()


def maker(stream, n, world, rank, workers):
    def make():
        torch.manual_seed(0)  # the loader's seed, from which each pass seeds the stream's RNGs
        dl = DataLoader(stream(n), batch_size=BATCH, num_workers=workers)
        return IterableShardDataLoader.from_dataloader(dl, DistContext(rank, world))

    return make


def states_run(loader, taken=0):
    """Drive ``loader`` to the end; the steps and, at every count of batches, the state there (through files)."""
    steps, states = [], {}
    for epoch in range(loader.epoch, EPOCHS):
        for batch in loader:
            steps.append(Step(epoch, batch_ids(batch), bool(loader.end_of_dataloader)))
            states[taken + len(steps)] = through_files(_positions(loader.state_dict()))
    return steps, states


def _positions(state):
    """The state less the items a pass read, which a stateful stream counts from its resume (its position is
    the dataset's state): what the snapshots record, the RNG states and the dataset's position, stays."""
    snapshots = [{k: v for k, v in s.items() if k != "items" or "dataset" not in s} if s is not None else None
                 for s in state["stream"]["snapshots"]]
    return dict(state, stream=dict(state["stream"], snapshots=snapshots))


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _points(reference, workers):
    """After the first global batch, inside the last global batch's step (the one before it and its own),
    the epoch's end and the next epoch; every point without workers."""
    end = next(i + 1 for i, step in enumerate(reference) if step.end_of_dataloader)
    if not workers:
        return list(range(1, len(reference)))
    return [1, end - 1, end + 1]


@pytest.mark.parametrize("stream,world,workers", [
    pytest.param(NoisyStream, 2, 0, id="stateful-w2"),
    pytest.param(NoisyOpaqueStream, 3, 0, id="opaque-w3"),
    pytest.param(NoisyStream, 5, 0, id="stateful-w5"),
    pytest.param(NoisyStream, 3, 2, id="stateful-w3-workers2"),
    pytest.param(NoisyOpaqueStream, 2, 2, id="opaque-w2-workers2"),
])
def test_a_resumed_stream_pads_its_last_global_batch_as_the_uninterrupted_run_and_changes_nothing_else(
        stream, world, workers):
    n = (3 * world * BATCH + 1) * max(workers, 1)  # each worker's share ends one item into a global batch
    for rank in sorted({world - 1} if workers else {0, world - 1}):  # the last rank re-reads the most
        make = maker(stream, n, world, rank, workers)
        reference, ref_states = states_run(make())
        ref_steps, saved = [], {}
        first = make()  # the states to resume from, saved through the on-disk format
        for epoch in range(EPOCHS):
            for batch in first:
                ref_steps.append(Step(epoch, batch_ids(batch), bool(first.end_of_dataloader)))
                saved[len(ref_steps)] = through_files(first.state_dict(), rank)
        assert_same_stream(reference, ref_steps, "a run saving at every batch")
        for point in _points(reference, workers):
            loader = make()
            loader.load_state_dict(saved[point])
            resumed, states = states_run(loader, taken=point)
            assert_same_stream(reference, reference[:point] + resumed, [point])
            # the RNG states and the dataset position the snapshots record after the re-read are unchanged
            for count, state in states.items():
                assert _same(state, ref_states[count]), f"rank {rank} resumed at {point}: state at {count} differs"


def test_a_stream_state_without_drop_last_does_not_grow_with_the_number_of_ranks():
    def size(world):
        make = maker(CountingStream, 4 * world * BATCH, world, world - 1, 0)
        loader = make()
        next(iter(loader))
        return sum(len(part) for part in _files.encode_state(loader.state_dict()).values())

    small, large = size(4), size(64)
    assert abs(large - small) <= 8, f"rank W-1's state: {small} bytes at 4 ranks, {large} bytes at 64"


def test_a_checkpoint_holding_the_first_global_batch_still_pads_with_it():
    """A state written before the first items were left out of it holds them in every snapshot ("first")."""
    world, rank, n = 2, 1, 2 * 2 * BATCH + 1
    make = maker(CountingStream, n, world, rank, 0)
    reference, _ = states_run(make())
    loader = make()
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    for snapshot in state["stream"]["snapshots"]:
        snapshot["first"] = [0, 1, 2, 3]  # what the old code kept: the pass's first global batch, W x batch_size
    resumed = make()
    resumed.load_state_dict(through_files(state, rank))
    steps, _ = states_run(resumed, taken=1)
    assert_same_stream(reference, reference[:1] + steps, [1])

    for snapshot in state["stream"]["snapshots"]:
        snapshot["first"] = [90, 91, 92, 93]  # it is used as it is, not read again
    resumed = make()
    resumed.load_state_dict(through_files(state, rank))
    assert [batch_ids(batch) for batch in resumed] == [(6, 7), (91, 92)]
