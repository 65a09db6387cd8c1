"""``Mixture`` through the package's prepared loaders (shard and dispatcher) on ranks simulated in one process:
kills at random batches, resumes on other worker and process counts, weight changes at a resume agreed by
every worker share (``GlobalStream.agree``), and per-source accounting from a loader's state."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from torch.utils.data import DataLoader

from accelerate_stateful import DispatchDataLoader, DistContext, IterableShardDataLoader, Mixture

from harness import run_loop, through_files
from test_mixture import CONFIGS, assert_each_source_read_in_order, mixture, source_of

EPOCHS, BATCH = 2, 3
NEW = {"a": 0, "b": 1, "c": 3}


def make(workers, weights=None, world=1, rank=0, dispatch=False, **kwargs):
    """The prepared loader over a mixture of a list (a), a stateful iterable (b) and a list (c)."""
    mix = mixture(weights, **kwargs.pop("mix", {}))
    dl = DataLoader(mix, batch_size=BATCH, num_workers=workers, generator=torch.Generator().manual_seed(7), **kwargs)
    build = DispatchDataLoader if dispatch else IterableShardDataLoader
    return build.from_dataloader(dl, DistContext(rank, world))


def run_chain(links, epochs=EPOCHS, **kwargs):
    """Run ``links`` = ``[(workers, weights, stop), ...]``, each resuming the previous one's saved state.

    Returns the steps seen and the state each link saved (``None`` for the last).
    """
    seen, state, states = [], None, []
    for workers, weights, stop in links:
        loader = make(workers, weights, **kwargs)
        if state is not None:
            loader.load_state_dict(through_files(state, kwargs.get("rank", 0)))
        steps, state = run_loop(loader, epochs, None if stop is None else (stop, "in_loop"), taken=len(seen))
        seen += steps
        states.append(state)
    return seen, states


_UNINTERRUPTED: dict = {}


def uninterrupted(workers, seed=5, weights=None):
    key = (workers, seed, str(weights))
    if key not in _UNINTERRUPTED:
        _UNINTERRUPTED[key] = run_chain([(workers, weights, None)], mix={"seed": seed})[0]
    return _UNINTERRUPTED[key]


def epoch(steps, e):
    return [s for s in steps if s.epoch == e]


def ids(steps):
    return [i for s in steps for i in s.ids]


def _chains(count, seed=3):
    """Random mixtures (seed, weights), kill points and worker counts (0 to 3): two kills in the first epoch."""
    rng = random.Random(seed)
    for _ in range(count):
        mix_seed, weights = rng.choice(CONFIGS)
        length = len(epoch(uninterrupted(0, mix_seed, weights), 0))
        first, second = sorted(rng.sample(range(1, length), 2))
        workers = [rng.randrange(4) for _ in range(3)]
        yield pytest.param(workers, [first, second], mix_seed, weights,
                           id=f"seed{mix_seed}-workers{'-'.join(map(str, workers))}-at{first}-{second}")


@pytest.mark.parametrize("workers,stops,seed,weights", list(_chains(6)))
def test_killed_twice_and_resumed_on_other_worker_counts_the_epoch_is_the_uninterrupted_runs(workers, stops, seed,
                                                                                           weights):
    """The interrupted epoch is the first run's (its worker shares continue); the next is a fresh run's."""
    links = [(workers[0], weights, stops[0]), (workers[1], weights, stops[1]), (workers[2], weights, None)]
    seen, _ = run_chain(links, mix={"seed": seed})
    assert epoch(seen, 0) == epoch(uninterrupted(workers[0], seed, weights), 0)
    assert epoch(seen, 1) == epoch(uninterrupted(workers[2], seed, weights), 1)
    assert_each_source_read_in_order(ids(epoch(seen, 0)))


def _schedules(state):
    return [snap["dataset"]["position"]["schedule"] for snap in state["stream"]["snapshots"] if snap is not None]


def _next_indices(state):
    return [snap["dataset"]["position"]["next"] for snap in state["stream"]["snapshots"] if snap is not None]


@pytest.mark.parametrize("after", [0, 2, 3])
def test_a_weight_change_at_a_resume_with_two_workers_switches_every_share_at_one_sample(after, caplog):
    first, stop = 5, 9
    with caplog.at_level(logging.WARNING, logger="accelerate_stateful"):
        seen, states = run_chain([(2, None, first), (2, NEW, stop), (after, NEW, None)], epochs=1)
    switch = max(_next_indices(states[0]))
    assert len(set(_next_indices(states[0]))) > 1, "the shares stood at different samples"
    schedules = _schedules(states[1])
    assert len(schedules) == 2 and all(s == [[0, {"a": 1, "b": 1, "c": 2}], [switch, NEW]] for s in schedules)
    got = ids(seen)
    assert_each_source_read_in_order(got)
    old = [source_of(i) for i in mixture()]
    assert sum(source_of(i) == "a" for i in got) == old[:switch].count("a"), "no 'a' drawn from the switch on"
    lines = [r.getMessage() for r in caplog.records if "weights change" in r.getMessage()]
    assert lines == [lines[0]] and f"from global sample {switch} on" in lines[0] and "{a: 1, b: 1, c: 2}" in lines[0]


def test_the_same_weights_at_every_resume_give_the_uninterrupted_stream_and_log_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="accelerate_stateful"):
        seen, _ = run_chain([(2, None, 4), (2, {"a": 2, "b": 2, "c": 4}, 8), (2, None, None)])
    assert seen == uninterrupted(2)
    assert not [r for r in caplog.records if "weights change" in r.getMessage()]


def test_set_weights_between_epochs_reaches_persistent_workers():
    loader = make(2, persistent_workers=True)
    first = [s for s in loader]
    loader.dataset.set_weights({"a": 0, "b": 0, "c": 1})
    loader.set_epoch(1)
    second = [s for s in loader]
    assert {source_of(i) for b in first for i in b.tolist()} == {"a", "b", "c"}
    assert {source_of(i) for b in second for i in b.tolist()} == {"c"}


@pytest.mark.parametrize("dispatch", [False, True], ids=["shard", "dispatch"])
def test_delivered_counts_from_a_loaders_state_are_what_the_loop_took(dispatch):
    seen, states = run_chain([(3, None, 7)], epochs=1, dispatch=dispatch)
    counts = mixture().delivered(states[0])
    got = ids(seen)
    assert counts == {name: sum(source_of(i) == name for i in got) for name in "abc"}


def _sized():
    """A fixed epoch length: killed after two steps, what is left of each worker share (and of the dispatcher's
    stream) is a whole number of global batches on 1, 2 or 3 ranks, so no rank pads its last batch."""
    return {"mix": {"sizes": (100, 100, 100), "on_exhausted": "restart", "samples_per_epoch": 84}}


def _ranks_run(links, world_before, world_after, dispatch):
    """Each simulated rank runs its own chain; the links before the kill run on ``world_before`` ranks."""
    got, states = [], {}
    kill_links, rest = links[:1], links[1:]
    for rank in range(world_before):
        seen, saved = run_chain(kill_links, epochs=1, world=world_before, rank=rank, dispatch=dispatch, **_sized())
        got += ids(seen)
        states[rank] = saved[0]
    for rank in range(world_after):
        loader = make(rest[0][0], rest[0][1], world=world_after, rank=rank, dispatch=dispatch, **_sized())
        loader.load_state_dict(through_files(states[0], 0) if dispatch or world_before != world_after
                               else through_files(states[rank], rank))
        seen, state = run_loop(loader, 1)
        got += ids(seen)
    return got


@pytest.mark.parametrize("dispatch", [False, True], ids=["shard", "dispatch"])
@pytest.mark.parametrize("before,after", [(2, 3), (2, 1)])
def test_a_weight_change_on_another_number_of_processes_loses_and_repeats_nothing(dispatch, before, after):
    got = _ranks_run([(2, None, 2), (2, NEW, None)], before, after, dispatch)
    assert len(got) == 84
    assert_each_source_read_in_order(got, sizes=(100, 100, 100))


def test_a_streaming_dataset_from_local_parquet_in_the_mixture_resumes_with_a_weight_change(tmp_path):
    """A ``datasets.IterableDataset`` (streamed from a local parquet file) beside a ``datasets.Dataset``, read
    whole by each of two workers, killed and resumed on three workers with new weights."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    datasets.disable_progress_bars()
    path = tmp_path / "b.parquet"
    pq.write_table(pa.table({"id": [1000 + i for i in range(30)]}), path)

    def build(workers, weights):
        streamed = datasets.load_dataset("parquet", data_files=str(path), split="train", streaming=True)
        mapped = datasets.Dataset.from_dict({"id": list(range(40))})
        mix = Mixture({"a": mapped, "b": streamed, "c": [{"id": 2000 + i} for i in range(60)]},
                      weights or {"a": 1, "b": 1, "c": 2}, seed=5)
        dl = DataLoader(mix, batch_size=BATCH, num_workers=workers, generator=torch.Generator().manual_seed(7))
        return IterableShardDataLoader.from_dataloader(dl, DistContext(0, 1))

    head, state = run_loop(build(2, None), 1, (4, "in_loop"))
    resumed = build(3, NEW)
    resumed.load_state_dict(through_files(state))
    rest, _ = run_loop(resumed, 1, taken=4)
    got = ids(head + rest)
    assert_each_source_read_in_order(got)
    assert any(source_of(i) == "b" for i in ids(rest)), "the streamed source is read after the resume"


def test_a_mixture_of_mixtures_agrees_a_weight_change_of_the_inner_one(caplog):
    """The outer mixture passes the loader's agreement on to an inner one: its switch is one sample for all."""
    from test_mixture import Counter

    def build(workers, inner_weights):
        inner = Mixture({"b": Counter(1000, 200), "c": [2000 + i for i in range(200)]}, inner_weights, seed=9)
        outer = Mixture({"a": list(range(200)), "inner": inner}, {"a": 1, "inner": 2}, seed=4)
        dl = DataLoader(outer, batch_size=BATCH, num_workers=workers, generator=torch.Generator().manual_seed(7))
        return IterableShardDataLoader.from_dataloader(dl, DistContext(0, 1))

    head, state = run_loop(build(2, {"b": 1, "c": 1}), 1, (5, "in_loop"))
    resumed = build(2, {"b": 0, "c": 1})
    resumed.load_state_dict(through_files(state))
    with caplog.at_level(logging.WARNING, logger="accelerate_stateful"):
        rest, _ = run_loop(resumed, 1, taken=5)
    assert_each_source_read_in_order(ids(head + rest), sizes=(200, 200, 200))
    lines = [r.getMessage() for r in caplog.records if "weights change" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("accelerate-stateful: source 'inner': Mixture: weights change")


def test_a_source_missing_on_resume_is_refused_before_any_batch_on_the_loader():
    from accelerate_stateful import CheckpointError

    _, state = run_loop(make(2), 1, (3, "in_loop"))
    fewer = Mixture({"a": list(range(40)), "c": [2000 + i for i in range(60)]}, {"a": 1, "c": 1}, seed=5)
    loader = IterableShardDataLoader.from_dataloader(DataLoader(fewer, batch_size=BATCH), DistContext(0, 1))
    loader.load_state_dict(through_files(state))
    with pytest.raises(CheckpointError, match=r"source\(s\) \['b'\].*pass them again, with weight 0"):
        next(iter(loader))
