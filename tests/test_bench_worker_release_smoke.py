"""The worker-release benchmark still runs: the prepared loader's cases on one worker, and its table (no figure is
checked; the plain torch cases are left out here, since each waits out torch's join timeout)."""

from __future__ import annotations

import math

import pytest

from scripts import load_script


@pytest.fixture()
def bench(fresh_accelerate_state):
    return load_script("benchmarks/bench_worker_release.py", "bench_worker_release")


def test_the_prepared_loaders_cases_run_and_the_table_reads_them(bench):
    found = {}
    for hold in bench.HOLDS:
        seconds = bench.release_seconds(bench.KINDS[1], hold, 1)
        assert isinstance(seconds, float) and math.isfinite(seconds) and seconds >= 0
        found[(bench.KINDS[1], hold)] = (seconds, seconds)
        found[(bench.KINDS[0], hold)] = (1.0, 1.0)
    text = bench.table(found, 1, 1)
    assert text.count("| persistent |") == 2 and text.count("| live pass |") == 2
