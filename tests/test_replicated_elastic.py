"""A stream read whole by every rank (Accelerate's IterableDatasetShard) resumes on another number of processes.

Its position is one count per worker on one stream, the same on every rank: the new ranks slice the next
global batches at their own size. Ranks are simulated in one process.
"""

from __future__ import annotations

import logging

import pytest
from torch.utils.data import DataLoader

from accelerate_stateful import DistContext, IterableShardDataLoader, UnsupportedConfigError

from harness import through_files
from streams import CountingStream, OpaqueStream

N = 23


def make(world, rank, *, workers=0, opaque=False, split=False, n=N):
    ds = OpaqueStream(n) if opaque else CountingStream(n)
    dl = DataLoader(ds, batch_size=6 if split else 2, num_workers=workers)  # split: 6 divides among 1, 2, 3
    return IterableShardDataLoader.from_dataloader(dl, DistContext(rank, world), split_batches=split)


def save_after(world, steps, **kw):
    taken, states = [], []
    for rank in range(world):
        dl = make(world, rank, **kw)
        it = iter(dl)
        taken += [i for _ in range(steps) for i in next(it).tolist()]
        states.append(through_files(dl.state_dict(), rank))
        del it
    return taken, states


@pytest.mark.parametrize("opaque", [False, True], ids=["stateful", "opaque"])
@pytest.mark.parametrize("world,new_world,workers,split", [
    (1, 2, 0, False), (2, 3, 0, True), (3, 2, 0, False), (2, 1, 0, False), (3, 1, 2, False), (1, 3, 2, True),
])
def test_every_unconsumed_sample_comes_once_and_nothing_taken_comes_back(world, new_world, workers, split, opaque,
                                                                        caplog):
    for steps in (1, 2):
        taken, states = save_after(world, steps, workers=workers, opaque=opaque, split=split)
        rest, replayed = [], []
        with caplog.at_level(logging.WARNING, logger="accelerate_stateful"):
            for rank in range(new_world):
                dl = make(new_world, rank, workers=workers, opaque=opaque, split=split)
                dl.load_state_dict(states[0])  # every new rank reads the main process's state
                rest += [i for b in dl for i in b.tolist()]
                replayed.append(dl.replayed_samples)
                assert dl.epoch == 1
        fresh = [i for i in rest if i not in set(taken)]
        assert sorted(set(fresh)) == sorted(set(range(N)) - set(taken))
        # besides the padding that completes each worker's last global batch, every sample comes once
        padding = len(rest) - len(set(fresh))
        per_step = (6 if split else 2 * new_world)
        assert padding < per_step * max(workers, 1)
        if opaque:
            assert all(r > 0 for r in replayed)
            assert "OpaqueStream has no state_dict" in caplog.text
        else:
            assert replayed == [0] * new_world


def test_later_epochs_after_the_rescale_are_a_fresh_runs():
    _, states = save_after(2, 3)
    resumed = [make(3, r) for r in range(3)]
    fresh = [make(3, r) for r in range(3)]
    for dl in resumed:
        dl.load_state_dict(states[0])
        list(dl)
    for dl in fresh:
        list(dl)
    assert [[b.tolist() for b in dl] for dl in resumed] == [[b.tolist() for b in dl] for dl in fresh]


@pytest.mark.parametrize("workers,new_workers", [(2, 3), (3, 0), (0, 2)])
def test_the_worker_count_may_change_with_the_number_of_processes(workers, new_workers):
    """The saved run's logical workers continue on the new ranks' workers (test_stream_workers_elastic.py)."""
    taken, states = save_after(2, 1, workers=workers)
    rest = []
    for rank in range(3):
        dl = make(3, rank, workers=new_workers)
        dl.load_state_dict(states[0])
        rest += [i for b in dl for i in b.tolist()]
    fresh = [i for i in rest if i not in set(taken)]
    assert sorted(set(fresh)) == sorted(set(range(N)) - set(taken))
    assert len(rest) - len(set(fresh)) < 2 * 3 * max(workers, 1)  # the padding of each share's last global batch


def test_one_process_to_several_is_no_longer_refused_with_an_internal_field():
    _, states = save_after(1, 2)
    dl = make(2, 1)
    dl.load_state_dict(states[0])
    assert "sliced_per_rank" not in str(states[0]["config"])


def hf_stream(shards, world, rank):
    import datasets

    ds = datasets.Dataset.from_dict({"id": list(range(N))}).to_iterable_dataset(num_shards=shards)
    return IterableShardDataLoader.from_dataloader(DataLoader(ds, batch_size=2), DistContext(rank, world))


@pytest.mark.parametrize("world,new_world", [(1, 2), (2, 3)])
def test_a_hugging_face_stream_every_rank_reads_whole_resumes_on_another_number_of_processes(world, new_world):
    taken, states = [], []
    for rank in range(world):
        dl = hf_stream(1, world, rank)
        it = iter(dl)
        taken += [i for _ in range(2) for i in next(it)["id"].tolist()]
        states.append(through_files(dl.state_dict(), rank))
        del it
    rest = []
    for rank in range(new_world):
        dl = hf_stream(1, new_world, rank)
        dl.load_state_dict(states[0])
        rest += [i for b in dl for i in b["id"].tolist()]
    assert sorted(set(rest) - set(taken)) == sorted(set(range(N)) - set(taken))
    assert len(rest) - len(set(rest) - set(taken)) < 2 * new_world


@pytest.mark.parametrize("shards,world,new_world,says", [
    (2, 1, 2, "each process reads its own shards"),  # one process read it whole; two split it by shard
    (2, 2, 3, "every process reads the whole stream"),  # split by shard on two; too few shards for three
    (4, 2, 3, "same number of processes .*num_workers may change"),  # split by shard on both, into other parts
])
def test_a_change_between_reading_whole_and_by_shard_is_refused_saying_what_the_processes_read(
        shards, world, new_world, says):
    state = through_files(hf_stream(shards, world, 0).state_dict())
    with pytest.raises(UnsupportedConfigError, match=says) as err:
        hf_stream(shards, new_world, 0).load_state_dict(state)
    assert f"--num_processes {world}" in str(err.value) and "sliced" not in str(err.value)


@pytest.mark.parametrize("workers,new_workers", [(0, 1), (1, 0)])
def test_no_workers_and_one_worker_both_read_the_stream_whole_so_either_may_follow_the_other(workers, new_workers):
    taken, states = save_after(2, 2, workers=workers)
    rest = []
    for rank in range(3):
        dl = make(3, rank, workers=new_workers)
        dl.load_state_dict(states[0])
        rest += [i for b in dl for i in b.tolist()]
    assert sorted(set(rest) - set(taken)) == sorted(set(range(N)) - set(taken))


def test_a_state_written_before_the_reading_was_recorded_still_resumes_on_the_same_topology():
    taken, states = save_after(2, 2)
    old = {**states[1], "config": {**states[1]["config"], "sliced_per_rank": True}}
    old["stream"] = {k: v for k, v in old["stream"].items() if k != "reading"}
    resumed, current = make(2, 1), make(2, 1)
    resumed.load_state_dict(old)
    current.load_state_dict(states[1])
    assert [b.tolist() for b in resumed] == [b.tolist() for b in current]
    with pytest.raises(UnsupportedConfigError, match="--num_processes 2"):
        make(3, 0).load_state_dict({**old, "topology": {**old["topology"], "rank": 0}})


# ---------------------------------------------------------------- chained: world -> new world -> same new world
CHAIN_N = 13  # small, so every save point of every leg is tried in seconds
_SAVED_RUNS: dict = {}


def _leg(world, states, workers, split):
    """Each rank's batches to the epoch's end, from its own state (or rank 0's on another number of processes),
    and its state before each batch and after each (a save inside the loop)."""
    batches, saves = [], []
    for rank in range(world):
        dl = make(world, rank, workers=workers, split=split, n=CHAIN_N)
        if states is not None:
            dl.load_state_dict(states[rank] if len(states) == world else states[0])
        got, saved = [], [dl.state_dict()]
        for batch in dl:
            got.append(batch.tolist())
            saved.append(dl.state_dict())
        batches.append(got)
        saves.append(saved)
    return batches, saves


def _saved_run(world, workers, split):
    """The interrupted run (read by its own workers), shared by every new number of processes."""
    key = (world, workers, split)
    if key not in _SAVED_RUNS:
        _SAVED_RUNS[key] = _leg(world, None, workers, split)
    return _SAVED_RUNS[key]


def _ids(batches):
    return {i for batch in batches for i in batch}


@pytest.mark.parametrize("split", [False, True], ids=["per-rank", "split"])
@pytest.mark.parametrize("workers", [0, 1, 2])
@pytest.mark.parametrize("world,new_world", [(w, n) for w in (1, 2, 3) for n in (1, 2, 3)])
def test_a_resumed_epoch_saved_again_and_resumed_again_goes_on_as_the_first_resume(world, new_world, workers, split):
    """Saved after s1 batches on ``world`` processes, resumed on ``new_world`` (every rank from rank 0's state) to
    the epoch's end; resumed again from each rank's state after s2 of those batches, the rest is the first
    resume's from s2 on, and the three legs together read every sample. The resumed legs continue the saved
    run's logical workers in the main process (as a loader with num_workers=0 does), so the saved layout,
    its rotation and counts, and what a save in that layout records are all on the chain."""
    run, saves = _saved_run(world, workers, split)
    for s1 in range(len(run[0]) + 1):
        first, resaves = _leg(new_world, [through_files(saves[rank][s1], rank) for rank in range(world)], 0, split)
        for s2 in range(len(first[0]) + 1):
            states = [through_files(resaves[rank][s2], rank) for rank in range(new_world)]
            second, _ = _leg(new_world, states, 0, split)
            assert second == [first[rank][s2:] for rank in range(new_world)], (s1, s2)
            chain = [b for r in run for b in r[:s1]] + [b for r in first for b in r[:s2]] + sum(second, [])
            assert _ids(chain) == set(range(CHAIN_N)), (s1, s2)


def test_a_chain_with_two_workers_on_every_leg_gives_back_no_batch_taken_before_the_second_save():
    """Issue 25 item 11's chain with real workers on every leg: 2 processes, saved after 2 batches; 3 processes,
    saved after 3 (``[20, 22]``, worker 0's, is the third: the loop received it, so it is taken); 3 again goes
    on with the fourth. The issue's script broke out of ``enumerate(loader)`` at ``k == steps``, which had
    received ``steps + 1`` batches, and compared the second resume with the first from ``steps``."""
    _, saves = save_after(2, 2, workers=2)
    first, resaves = [], []
    for rank in range(3):
        dl = make(3, rank, workers=2)
        dl.load_state_dict(saves[0])
        it = iter(dl)
        first.append([next(it).tolist() for _ in range(3)])
        resaves.append(through_files(dl.state_dict(), rank))
        first[-1] += [b.tolist() for b in it]
    assert first[0] == [[8, 10], [9, 11], [20, 22], [21, 1]]
    for rank in range(3):
        dl = make(3, rank, workers=2)
        dl.load_state_dict(resaves[rank])
        assert [b.tolist() for b in dl] == first[rank][3:]
