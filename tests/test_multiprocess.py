"""Exact resume with real processes on gloo: two ``accelerate launch`` per world size.

Each launch runs every scenario of one set of ``mp_scenarios.ALL_SETS`` (see that module for what a
scenario checks) and every rank writes a JSON verdict per scenario. The ``world{N}`` launches read
map-style data on every rank and cover world sizes 1, 2 and 3, num_workers 0 and 2, shuffle on and off,
drop_last, even_batches, split_batches, gradient accumulation 1 and 2, with every pair of those settings
in each launch instead of the full product. The ``sources-world{N}`` launches run the dispatcher over
map-style and iterable datasets and iterable datasets read by every rank, stateful and opaque, each
with and without workers, every pair of num_workers, split_batches and drop_last across the launches,
and check each against Accelerate's own loader. They also run Hugging Face ``datasets`` sources (a
``Dataset`` and an ``IterableDataset``, in both modes, with and without workers, on 1, 2 and 3
processes) and a ``RoundRobinDataset`` whose source may be opened once, on rank 0, outside the workers.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Callable

import pytest

import mp_harness
from mp_scenarios import (ALL_SETS, HF_STREAMS, POINT_KINDS, SCENARIO_SETS, SOURCE_SETS, chains, dispatches,
                          expected_ids, is_iterable, labelled_points, reads_whole_shards, resumed_points,
                          scenario_chains)

SCRIPT = Path(__file__).with_name("mp_scenarios.py")
# Which save points each scenario resumes from: ``mp_scenarios.resumed_points`` (read here, at import: the tests'
# fixtures strip ACCELERATE_* variables). ``make test-full`` resumes every point.
RESUME_SAMPLE = os.environ.get("ACCELERATE_STATEFUL_GRID", "") or "make-test"
LAUNCH_TIMEOUT_S = 400  # a launch takes 15-90 s; a stuck one is ended sooner, by the harness's watchdog

# The two-valued settings whose every pair of values each launch must cover.
FACTORS = {
    "num_workers": lambda s: s["workers"] > 0,
    "shuffle": lambda s: s["shuffle"] != "off",
    "drop_last": lambda s: s["drop_last"],
    "even_batches": lambda s: s["even"],
    "split_batches": lambda s: s["split"],
    "gradient_accumulation": lambda s: s["ga"] > 1,
}


def _world(set_name: str) -> int:
    return int(set_name.rsplit("world", 1)[1])


@pytest.mark.multiprocess
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("set_name", list(ALL_SETS))
def test_every_rank_resumes_exactly_in_real_processes(set_name, tmp_path):
    world = _world(set_name)
    expected = expected_ids(set_name)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    done = mp_harness.launch(mp_harness.accelerate_command(SCRIPT, [out_dir, set_name], world), tmp_path / "launch",
                             timeout_s=LAUNCH_TIMEOUT_S, watch=[out_dir], HF_HOME=str(tmp_path / "hf_home"),
                             RESUME_SAMPLE=RESUME_SAMPLE)
    print(f"{set_name}: {len(expected)} scenarios on {world} processes in {done.seconds:.1f} s")

    failures, kinds = [], set()
    for rank in range(world):
        path = out_dir / f"rank{rank}.json"
        if not path.is_file():
            failures.append(f"rank {rank} wrote no results")
            continue
        results = json.loads(path.read_text())
        ran = [r["id"] for r in results]
        kinds.update((r["workers"] > 0, kind) for r in results if "workers" in r for kind in r["resumed_kinds"])
        if ran != expected:
            failures.append(f"rank {rank} finished {ran}, expected {expected}")
        failures += [
            f"{r['id']} on rank {rank}: {r['difference']}"
            + "".join(f"\n  and: {other}" for other in r.get("other_differences", []))
            for r in results if not r["passed"]
        ]
    for workers in (False, True):
        missed = [kind for kind in POINT_KINDS if (workers, kind) not in kinds]
        if done.ok and missed:
            failures.append(f"no scenario {'with' if workers else 'without'} workers resumed from {missed}")
    assert done.ok and not failures, (
        f"{set_name}: {len(failures)} failure(s):\n" + "\n\n".join(failures) + f"\n\n{done.report()}"
    )


@pytest.mark.parametrize("set_name", list(SCENARIO_SETS))
def test_scenario_sets_cover_every_pair(set_name):
    """Within each launch, every pair of values of every two settings occurs in some scenario."""
    rows = [{name: bool(value(s)) for name, value in FACTORS.items()} for s in SCENARIO_SETS[set_name]]
    missing = [
        f"{a}={va} with {b}={vb}"
        for a, b in itertools.combinations(FACTORS, 2)
        for va, vb in itertools.product((False, True), repeat=2)
        if not any(row[a] == va and row[b] == vb for row in rows)
    ]
    assert not missing, f"{set_name} never runs: {', '.join(missing)}"


# The ways a source is read: the dispatcher over map-style data, over an iterable dataset, an iterable
# dataset read by every rank, map-style data each rank reads its shard of, and a round-robin source.
def _kind(s: dict) -> str:
    if s["data"] == "round-robin":
        return "round-robin"
    return ("diter" if dispatches(s) else "siter") if is_iterable(s) else ("dmap" if dispatches(s) else "shard")


SOURCE_FACTORS = {
    "num_workers": lambda s: s["workers"] > 0,
    "split_batches": lambda s: s["split"],
    "drop_last": lambda s: s["drop_last"],
}


@pytest.mark.parametrize("kind", ["dmap", "diter", "siter"])
def test_source_sets_cover_every_pair(kind):
    """Across the launches, each source kind runs every pair of values of num_workers, split_batches and
    drop_last; within each launch, it runs with and without workers."""
    rows = [s for sets in SOURCE_SETS.values() for s in sets if _kind(s) == kind]
    missing = [
        f"{a}={va} with {b}={vb}"
        for a, b in itertools.combinations(SOURCE_FACTORS, 2)
        for va, vb in itertools.product((False, True), repeat=2)
        if not any(bool(SOURCE_FACTORS[a](s)) == va and bool(SOURCE_FACTORS[b](s)) == vb for s in rows)
    ]
    assert not missing, f"{kind} never runs: {', '.join(missing)}"
    for set_name, scenarios in SOURCE_SETS.items():
        workers = {s["workers"] for s in scenarios if _kind(s) == kind}
        assert workers == {0, 2}, f"{set_name} runs {kind} with num_workers in {sorted(workers)}, not 0 and 2"


def _sources(data: Callable[[str], bool]) -> list[tuple[int, dict]]:
    """(world size, scenario) for every source scenario whose ``data`` passes."""
    return [(_world(name), s) for name, sets in SOURCE_SETS.items() for s in sets if data(s["data"])]


def test_source_sets_run_hf_datasets_and_round_robin():
    """Across the launches: a ``datasets.Dataset`` shuffled by the DataLoader and a ``datasets.IterableDataset``
    in each mode with and without workers, on 1, 2 and 3 processes; the stream read by every rank both by whole
    shards and by slices, shuffled and not (shuffled only without workers: ``datasets`` cannot resume a shuffled
    multi-shard stream in a worker); a round-robin source with its transform in two workers on 1, 2 and 3
    processes, through the dispatcher on several."""
    table = _sources(lambda d: d == "hf-table")
    assert {(_kind(s), s["workers"]) for _, s in table} == {(k, w) for k in ("shard", "dmap") for w in (0, 2)}
    assert {w for w, _ in table} == {1, 2, 3} and all(s["shuffle"] != "off" for _, s in table)

    streams = _sources(lambda d: d in HF_STREAMS)
    assert {(_kind(s), s["workers"]) for _, s in streams} == {(k, w) for k in ("diter", "siter") for w in (0, 2)}
    assert {w for w, _ in streams} == {1, 2, 3}
    assert all(s["dispatch"] is None for _, s in streams if _kind(s) == "diter")
    several = [(w, s) for w, s in streams if _kind(s) == "siter" and w > 1]
    assert {reads_whole_shards(s, w) for w, s in several} == {False, True}
    assert {HF_STREAMS[s["data"]][1] for _, s in streams} == {False, True}
    assert not any(HF_STREAMS[s["data"]][1] and s["workers"] for _, s in streams)

    robin = _sources(lambda d: d == "round-robin")
    assert {w for w, _ in robin} == {1, 2, 3} and all(s["workers"] == 2 for _, s in robin)
    assert all(dispatches(s) for w, s in robin if w > 1)


def test_source_sets_resume_opaque_streams_in_both_modes_and_with_workers():
    opaque = [s for sets in SOURCE_SETS.values() for s in sets if "opaque" in s["data"]]
    assert {_kind(s) for s in opaque} == {"diter", "siter"}
    assert {s["workers"] for s in opaque} == {0, 2}
    assert {s["persistent"] for s in opaque if s["workers"]} == {False, True}


def test_source_sets_use_dispatch_default_for_iterables():
    """The dispatcher over an iterable dataset is reached by Accelerate's default (dispatch_batches=None)."""
    for sets in SOURCE_SETS.values():
        assert all(s["dispatch"] is None for s in sets if _kind(s) == "diter")


@pytest.mark.parametrize("set_name", list(ALL_SETS))
def test_scenario_datasets_leave_a_partial_last_batch(set_name):
    world = _world(set_name)
    for s in ALL_SETS[set_name]:
        global_batch = s["bs"] if s["split"] else s["bs"] * world
        assert s["n"] % global_batch != 0, f"{s['id']}: {s['n']} samples fill every batch of {global_batch}"
        assert not s["split"] or s["bs"] % world == 0, f"{s['id']}: split batch {s['bs']} on {world} ranks"


@pytest.mark.parametrize("sample", ["make-test", "other", "full"])
def test_every_kind_of_save_point_and_both_chains_are_resumed_by_the_scenarios_of_each_group(sample):
    """The scenarios of a group (a launch's with workers, or without: three or more) resume from every kind of
    point between them, whatever the epochs' lengths (short ones make two kinds one point), and run both chains
    of resumes; every scenario resumes from the point its chain starts from."""
    sizes = {len([c for c in scenarios if (c["workers"] > 0) == workers])
             for scenarios in ALL_SETS.values() for workers in (False, True)}
    assert min(sizes) >= 3, sizes
    for size in sorted(sizes | {3, 8}):
        for per_epoch in ([2, 2, 2], [3, 2, 2], [3, 3, 3], [5, 4, 4], [6, 6, 6], [9, 9, 9], [11, 7, 7]):
            labels = labelled_points(per_epoch)
            resumed = [resumed_points(per_epoch, place, size, sample) for place in range(size)]
            kinds = {kind for points in resumed for point in points for kind in labels[point]}
            assert kinds == set(POINT_KINDS), (size, per_epoch, sorted(set(POINT_KINDS) - kinds))
            runs = [scenario_chains(per_epoch, place, sample) for place in range(size)]
            assert {tuple(c) for chains_ in runs for c in chains_} == {tuple(c) for c in chains(per_epoch)}
            assert all(c[0] in points for points, chains_ in zip(resumed, runs) for c in chains_)
            if sample == "full":
                assert all(points == list(labels) for points in resumed)
                assert all(chains_ == chains(per_epoch) for chains_ in runs)
