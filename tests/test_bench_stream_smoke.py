"""The iterable-dataset benchmark still runs: its functions on tiny sizes (no figure is checked, only that there are
some)."""

from __future__ import annotations

import math

import pytest

from scripts import load_script


@pytest.fixture()
def bench(fresh_accelerate_state):
    return load_script("benchmarks/bench_stream.py", "bench_stream")


def _is_time(value: float) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value >= 0


def test_counter_stream_resumes_from_its_state_and_restarts_on_the_next_pass(bench):
    stream = bench.CounterStream(10, bench.StateSpec("tiny list", "list", 4))
    reader = iter(stream)
    assert [next(reader) for _ in range(3)] == [0, 1, 2]
    state = stream.state_dict()
    assert state == {"pos": 3, "buffer": [0, 0, 1, 2]}  # one slot overwritten per item read

    resumed = bench.CounterStream(10, bench.StateSpec("tiny list", "list", 4))
    resumed.load_state_dict(state)
    assert list(resumed) == [3, 4, 5, 6, 7, 8, 9]
    assert list(resumed) == list(range(10))  # the next pass starts over
    assert bench.expected_batch(10, 2, 2, 3).tolist() == [5, 7]  # worker 1's second batch


@pytest.mark.timeout(60)
def test_benchmark_functions_run_on_tiny_sizes_and_return_numbers(bench):
    accelerators = bench._accelerators()
    in_process = bench.bench_per_batch(8, bench.LIST_100K, batch_size=4, num_workers=0, rounds=1,
                                       accelerators=accelerators)
    with_workers = bench.bench_per_batch(8, bench.SMALL, batch_size=4, num_workers=2, rounds=1,
                                         accelerators=accelerators)
    checkpoint = bench.bench_checkpoint(bench.TENSOR_100K, batch_size=4, num_workers=2, batches=4, every=2,
                                        rounds=1, accelerators=accelerators)
    resume = bench.bench_resume(400, batch_size=4, num_workers=0, rounds=1, accelerators=accelerators)

    for results in (in_process, with_workers):
        assert [r.name for r in results] == list(bench.PER_BATCH_CONTENDERS)
        assert all(_is_time(r.us_per_batch) and _is_time(r.main_cpu_us) and _is_time(r.worker_cpu_us)
                   for r in results)
    assert [r.name for r in checkpoint] == list(bench.CHECKPOINT_CONTENDERS)
    assert all(_is_time(r.ms) and r.state_kib > 0 for r in checkpoint)
    assert [r.name for r in resume] == list(bench.RESUME_CONTENDERS)
    assert all(_is_time(t) for r in resume for t in [*r.seconds.values(), *r.best.values()])
    assert next(r for r in resume if r.name == bench.RESUME_OURS).exact is True

    report = bench.render(
        bench.environment(),
        {"batch_size": 4, "per_batch": {bench.LIST_100K.label: {0: (8, 1)}, bench.SMALL.label: {2: (8, 1)}},
         "step": {"ms": 0.0, "num_workers": 2, "states": {bench.SMALL.label: (8, 1)}},
         "checkpoint": {"batches": 4, "every": 2, "rounds": 1}, "resume": {0: (400, 1)}},
        {0: {bench.LIST_100K.label: in_process}, 2: {bench.SMALL.label: with_workers}},
        {bench.SMALL.label: with_workers},
        {2: {bench.TENSOR_100K.label: checkpoint}},
        {0: resume},
        bench.measured_item_cost_us(100),
    )
    assert bench.RESUME_OURS in report and "| --- |" in report


def test_main_writes_the_markdown_report_and_the_results_as_json(bench, tmp_path, monkeypatch):
    tiny = {
        "batch_size": 4,
        "per_batch": {bench.SMALL.label: {0: (4, 1)}},
        "step": {"ms": 1.0, "num_workers": 0, "states": {bench.SMALL.label: (3, 1)}},
        "checkpoint": {"batches": 2, "every": 1, "rounds": 1},
        "resume": {0: (200, 1)},
    }
    monkeypatch.setattr(bench, "QUICK_SIZES", tiny)
    out = tmp_path / "stream.md"

    assert bench.main(["--quick", "--markdown", str(out), "--json", str(tmp_path / "stream.json")]) == 0
    text = out.read_text(encoding="utf-8")
    plot = load_script("benchmarks/plot.py", "plot")  # what make bench draws from the JSON
    results = plot.load(tmp_path)
    assert [title for title, _ in plot.resume_panels(results)] == ["iterable stream, 200 items, num_workers=0"]
    assert [title for title, _ in plot.per_batch_panels(results)] == ["iterable stream, small state, num_workers=0"]
    assert "## C. Time to the first batch after resuming an iterable stream" in text
    assert "## B3. Cost of one state_dict() call mid-epoch" in text
    assert "## B2. What a loop with a 1 ms training step waits for" in text
