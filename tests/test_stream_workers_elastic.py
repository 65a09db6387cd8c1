"""A stream read per worker share, saved with num_workers=L and resumed with another num_workers=W.

The rest of the interrupted epoch is the uninterrupted L-worker run's, batch for batch (each of the L
logical workers continues where it stopped, on W physical workers or in the main process); the epochs
after it are a fresh W-worker run's. Ranks are simulated in one process (every rank reads the whole
stream and keeps its slice, so each rank's state is its own).
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from accelerate_stateful import DistContext, IterableShardDataLoader, UnsupportedConfigError

from harness import Step, run_loop, through_files
from streams import CountingStream, OpaqueStream

EPOCHS = 2
N, BATCH = 29, 3  # with 2 or 3 workers the shares end at different batches


class DrawingStream(IterableDataset):
    """An opaque stream whose items carry a draw from the global ``random`` RNG of the process reading it."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for i in range(worker, self.n, workers):
            yield i * 1000 + random.randrange(1000)


STREAMS = {"stateful": CountingStream, "opaque": OpaqueStream, "drawing": DrawingStream}


def make(stream, workers, world=1, rank=0, **settings):
    dl = DataLoader(STREAMS[stream](N), batch_size=BATCH, num_workers=workers,
                    generator=torch.Generator().manual_seed(7), **settings)
    return IterableShardDataLoader.from_dataloader(dl, DistContext(rank, world))


_RUNS: dict = {}


def uninterrupted(stream, workers, world=1, rank=0):
    key = (stream, workers, world, rank)
    if key not in _RUNS:
        _RUNS[key] = run_loop(make(stream, workers, world, rank), EPOCHS)[0]
    return _RUNS[key]


def expected(stream, saved_workers, workers, world=1, rank=0):
    """The L-worker run up to the end of epoch 0, then a fresh W-worker run's later epochs."""
    first = [s for s in uninterrupted(stream, saved_workers, world, rank) if s.epoch == 0]
    return first + [s for s in uninterrupted(stream, workers, world, rank) if s.epoch > 0]


def resumed_run(stream, chain, world=1, rank=0):
    """Run on ``chain[0][0]`` workers to batch ``chain[0][1]``, then resume on each next count in turn."""
    seen: list[Step] = []
    state = None
    for (workers, stop), nxt in itertools.zip_longest(chain, chain[1:]):
        loader = make(stream, workers, world, rank)
        if state is not None:
            loader.load_state_dict(through_files(state, rank))
        steps, state = run_loop(loader, EPOCHS, (stop, "in_loop") if stop is not None else None, taken=len(seen))
        seen += steps
    return seen


def _epoch_length(stream, workers, world=1):
    return sum(1 for s in uninterrupted(stream, workers, world) if s.epoch == 0)


def _points(stream, saved_workers, world=1):
    """After the first batch, mid-epoch, and after the epoch's last batch (still inside the loop)."""
    length = _epoch_length(stream, saved_workers, world)
    return {"early": 1, "mid": length // 2, "last": length}


CASES = [pytest.param(stream, saved, now, where, id=f"{stream}-L{saved}-W{now}-{where}")
         for stream in ("stateful", "opaque") for saved in (0, 1, 2, 3) for now in (0, 1, 2, 3, 4)
         for where in ("early", "mid", "last") if saved != now]


@pytest.mark.parametrize("stream,saved,now,where", CASES)
def test_the_interrupted_epoch_is_the_saved_runs_and_later_epochs_a_fresh_runs(stream, saved, now, where):
    stop = _points(stream, saved)[where]
    seen = resumed_run(stream, [(saved, stop), (now, None)])
    want = expected(stream, saved, now)
    assert seen == want
    ids = [i for s in seen if s.epoch == 0 for i in s.ids]
    assert sorted(ids) == list(range(N))  # nothing lost or repeated in the interrupted epoch


@pytest.mark.parametrize("saved,now", [(1, 0), (1, 3), (2, 0), (2, 1), (3, 1), (3, 2), (2, 4)])
def test_a_worker_that_plays_several_shares_gives_each_its_own_global_rngs(saved, now):
    """Each logical worker draws what it drew in the saved run, however many a process plays.

    Without workers the later epochs draw from the main process's own RNGs, which a fresh run had used
    for its first epoch (and the training loop uses too): only the interrupted epoch is compared there.
    """
    stop = _points("drawing", saved)["mid"]
    seen, want = resumed_run("drawing", [(saved, stop), (now, None)]), expected("drawing", saved, now)
    if now == 0:
        seen, want = [s for s in seen if s.epoch == 0], [s for s in want if s.epoch == 0]
    assert seen == want


@pytest.mark.parametrize("chain", [[(3, 2), (1, 5), (2, None)], [(2, 3), (0, 6), (4, None)],
                                   [(0, 2), (3, 4), (1, None)], [(3, 4), (2, 6), (2, None)]])
def test_a_chain_of_two_resumes_with_different_worker_counts(chain):
    seen = resumed_run("stateful", chain)
    assert seen == expected("stateful", chain[0][0], chain[-1][0])


@pytest.mark.parametrize("saved,now,where", [(3, 1, "mid"), (2, 0, "early"), (0, 3, "mid"), (1, 4, "last"),
                                             (3, 2, "last")])
def test_each_of_two_simulated_ranks_continues_its_slice(saved, now, where):
    stop = _points("stateful", saved, world=2)[where]
    for rank in (0, 1):
        seen = resumed_run("stateful", [(saved, stop), (now, None)], world=2, rank=rank)
        assert seen == expected("stateful", saved, now, world=2, rank=rank)


def test_persistent_workers_continue_the_interrupted_epoch_and_then_read_their_own_shares():
    def persistent(stream, workers, world=1, rank=0):
        return make(stream, workers, world, rank, persistent_workers=workers > 0)

    first, state = run_loop(persistent("stateful", 3), EPOCHS, (5, "in_loop"))
    resumed = persistent("stateful", 2)
    resumed.load_state_dict(through_files(state))
    seen = run_loop(resumed, EPOCHS, taken=5)[0]
    assert first + seen == expected("stateful", 3, 2)


def _init(worker_id):
    pass


@pytest.mark.parametrize("saved,now", [(3, 1), (2, 0), (0, 2)])
def test_a_worker_init_fn_is_refused_where_a_process_would_play_several_shares(saved, now):
    _, state = run_loop(make("stateful", saved, worker_init_fn=_init if saved else None), EPOCHS, (1, "in_loop"))
    with pytest.raises(UnsupportedConfigError, match=f"num_workers={now} and a worker_init_fn.*num_workers={saved}"):
        make("stateful", now, worker_init_fn=_init).load_state_dict(state)


def test_a_worker_init_fn_runs_per_share_where_each_worker_plays_one():
    _, state = run_loop(make("stateful", 2, worker_init_fn=_init), EPOCHS, (3, "in_loop"))
    resumed = make("stateful", 3, worker_init_fn=_init)
    resumed.load_state_dict(state)
    assert run_loop(make("stateful", 2), EPOCHS, (3, "in_loop"))[0] + run_loop(resumed, EPOCHS, taken=3)[0] \
        == expected("stateful", 2, 3)
