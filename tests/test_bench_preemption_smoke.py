"""The preemption benchmark still runs: both loops, handler off and on, a few steps each, and its table (no
figure is checked)."""

from __future__ import annotations

import math

import pytest

from scripts import load_script


@pytest.fixture()
def bench(fresh_accelerate_state):
    return load_script("benchmarks/bench_preemption.py", "bench_preemption")


def test_both_loops_run_with_the_handler_off_and_on_and_the_table_reads_them(bench):
    found = bench.timings(bench.WARMUP + 3, 1)
    for loop in bench.LOOPS:
        for preemption in (False, True):
            seconds = found[loop][preemption]
            assert isinstance(seconds, float) and math.isfinite(seconds) and seconds > 0
    assert [row[0] for row in bench.rows(found)] == list(bench.LOOPS)
