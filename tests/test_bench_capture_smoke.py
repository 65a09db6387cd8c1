"""The capture and data-state benchmarks still run on tiny sizes; what they say crosses per batch is checked,
no timing is."""

from __future__ import annotations

import math

import pytest

from scripts import load_script

TINY = {"batch_size": 4, "num_workers": 2, "buffer_size": 50, "batches": 6, "rounds": 1}


@pytest.fixture()
def capture(fresh_accelerate_state):
    return load_script("benchmarks/bench_capture.py", "bench_capture")


@pytest.mark.timeout(120)
def test_our_workers_send_nothing_per_batch_but_the_batch_and_its_two_int_tag(capture):
    names = (capture.BARE, capture.TORCHDATA, capture.OURS_DISPATCH)
    results = {r.name: r for r in capture.bench_capture(TINY, names=names)}

    assert list(results) == list(names)
    assert all(math.isfinite(r.us_per_batch) and r.us_per_batch > 0 for r in results.values())
    assert all(r.worker_faults >= 0 for r in results.values())  # counted, as the workers' CPU is
    ours = results[capture.OURS_DISPATCH]
    assert ours.channel_messages == TINY["num_workers"]  # one start instruction per worker, no state reply
    assert ours.extra_bytes < 64  # the (logical worker, batch number) tag
    assert results[capture.TORCHDATA].extra_bytes > 128  # the buffer's position, with every batch
    profile = capture.capture_profile(TINY, batches=4)
    assert profile["state_bytes"] > 0 and "capture (state_dict + RNG)" in "\n".join(capture.profile_table(profile))


@pytest.mark.timeout(60)
def test_the_data_state_benchmark_measures_every_pipeline_and_no_padding_batch_in_the_state(tmp_path):
    bench = load_script("benchmarks/bench_data_state.py", "bench_data_state")
    row = bench.bench_world(tmp_path, 4, buffer_size=20)

    assert set(row) == {"world", "map/ours", "map/torchdata", "lm/ours", "lm/torchdata", "lm, drop_last/ours"}
    assert all(f["bytes"] > 0 and f["files_read"] >= 1 for key, f in row.items() if key != "world")
    parts = dict(bench.state_parts(20, world=4)["parts"])
    assert not [p for p in parts if p.endswith("/first")]  # the padding's first items are read again, not kept
    assert "| lm |" in bench.state_table([row])
