"""A stream saved inside an epoch and resumed with another batch size, with ``drop_last=True`` (ranks simulated in
one process): the rest of the epoch goes on from the first item not handed out, in batches of the new size,
dropping only the epoch's last incomplete batch, so nothing taken comes back and nothing else is lost, on the
same or another number of workers and processes, shard mode and dispatcher. Without ``drop_last`` the change is refused (``test_rebatch.py``)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DataLoader

from accelerate_stateful import DispatchDataLoader, DistContext, IterableShardDataLoader

from harness import run_loop, through_files
from test_mixture import mixture


def make(workers, batch, dispatch, world=1, rank=0):
    dl = DataLoader(mixture(None), batch_size=batch, num_workers=workers, drop_last=True,
                    generator=torch.Generator().manual_seed(7))
    return (DispatchDataLoader if dispatch else IterableShardDataLoader).from_dataloader(dl, DistContext(rank, world))


def ids(steps) -> list:
    return [i for step in steps for i in step.ids]


SEQUENCE = ids(run_loop(make(0, 1, False), 1)[0])  # the mixture's global sequence, one item a batch


def expected_rest(before: list, batch: int) -> set:
    """What the resumed epoch must deliver: the sequence from the first item no share handed out (the batches
    taken are the sequence's first blocks: ``loaders/_frontier``), in whole batches of the new size."""
    start = len(before)
    assert set(before) == set(SEQUENCE[:start])
    rest = SEQUENCE[start:]
    return set(rest[: len(rest) // batch * batch])


@pytest.mark.parametrize("dispatch", [False, True], ids=["shard", "dispatcher"])
@pytest.mark.parametrize("workers", [(0, 0), (2, 2), (2, 0), (0, 3), (3, 1)], ids=lambda w: f"workers{w[0]}to{w[1]}")
@pytest.mark.parametrize("batches", [(3, 5), (4, 2)], ids=lambda b: f"batch{b[0]}to{b[1]}")
def test_each_share_goes_on_in_batches_of_the_new_size(dispatch, workers, batches):
    for stop in (1, 4, 7):
        steps, state = run_loop(make(workers[0], batches[0], dispatch), 1, (stop, "in_loop"))
        resumed = make(workers[1], batches[1], dispatch)
        resumed.load_state_dict(through_files(state))
        after = ids(run_loop(resumed, 1, taken=len(steps))[0])
        before = ids(steps)
        assert len(after) == len(set(after)) and not set(before) & set(after), f"stop {stop}: taken again"
        assert set(after) == expected_rest(before, batches[1]), f"stop {stop}: lost or added"
        assert all(len(step.ids) == batches[1] for step in run_loop(make(0, batches[1], dispatch), 1)[0])


@pytest.mark.parametrize("dispatch", [False, True], ids=["shard", "dispatcher"])
def test_on_another_number_of_processes_too(dispatch):
    before_world, after_world, stop = 2, 3, 3
    before, states = [], {}
    for rank in range(before_world):
        steps, states[rank] = run_loop(make(2, 3, dispatch, before_world, rank), 1, (stop, "in_loop"))
        before += ids(steps)
    after = []
    for rank in range(after_world):
        loader = make(0, 2, dispatch, after_world, rank)
        loader.load_state_dict(through_files(states[0]))
        after += ids(run_loop(loader, 1)[0])
    assert not set(before) & set(after) and len(after) == len(set(after))
    got = set(before) | set(after)
    assert got <= set(SEQUENCE) and len(set(SEQUENCE) - got) < 2 * 3 * 2  # at most the shares' dropped tails
