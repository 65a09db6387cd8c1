"""The benchmark script still runs: its functions on tiny sizes (no figure is checked, only that there are some)."""

from __future__ import annotations

import math

import pytest

from scripts import load_script


@pytest.fixture()
def bench(fresh_accelerate_state):
    return load_script("benchmarks/bench_loader.py", "bench_loader")


def _is_time(value: float) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value >= 0


@pytest.mark.timeout(60)
def test_benchmark_functions_run_on_tiny_sizes_and_return_numbers(bench, tmp_path):
    per_batch = bench.bench_per_batch(num_samples=200, batch_size=8, num_workers=0, rounds=1)
    resume = bench.bench_resume(num_samples=400, batch_size=8, rounds=1)

    assert [r.name for r in per_batch] == list(bench.PER_BATCH_CONTENDERS)
    assert all(_is_time(r.us_per_batch) and _is_time(r.first_batch_ms) and r.batches == 25 for r in per_batch)
    assert [r.name for r in resume] == list(bench.RESUME_CONTENDERS)
    assert all(_is_time(t) for r in resume for t in [*r.seconds.values(), *r.best.values()])
    ours = next(r for r in resume if r.name == bench.RESUME_OURS)
    assert ours.exact is True

    report = bench.render(bench.environment(), bench.FULL_SIZES, {0: per_batch}, resume)
    assert bench.RESUME_OURS in report and "| --- |" in report


def test_main_writes_the_markdown_report_and_the_results_the_figures_are_drawn_from(bench, tmp_path, monkeypatch):
    tiny = {"batch_size": 8, "per_batch": {0: (64, 1)}, "resume": (160, 1)}
    monkeypatch.setattr(bench, "QUICK_SIZES", tiny)
    out = tmp_path / "bench.md"

    assert bench.main(["--quick", "--markdown", str(out), "--json", str(tmp_path / "loader.json")]) == 0
    assert "## B. Time to the first batch after resuming" in out.read_text(encoding="utf-8")
    plot = load_script("benchmarks/plot.py", "plot")
    assert plot.main([str(tmp_path), str(tmp_path / "figures")]) == 0
    figures = ("resume.png", "per_batch.png", "resume_readme.png")
    assert all((tmp_path / "figures" / name).is_file() for name in figures)


def test_the_readme_figure_draws_ours_beside_skip_first_batches_and_statefuldataloader_on_linear_axes(tmp_path):
    """Issue 26: the README's figure, on log axes with every method, did not show the point at a glance."""
    plot = load_script("benchmarks/plot.py", "plot")
    seconds = {"0.1": 0.1, "0.5": 0.3, "0.9": 0.5}
    names = ["ours: load_state_dict", "accelerate: skip_first_batches", "StatefulDataLoader: load_state_dict",
             "accelerate stateful: load_state_dict"]
    documents = {"loader.json": {"environment": {}, "sizes": {"resume": [1000, 1]},
                                 "results": {"resume": [{"name": n, "seconds": seconds} for n in names]}}}
    ((title, results),) = plot.headline_panels(documents)
    assert [r["name"] for r in results] == names[:3]
    shown = []
    original = plot._resume_panel
    plot._resume_panel = lambda ax, *args, **kwargs: shown.append(ax) or original(ax, *args, **kwargs)
    try:
        assert plot.plot_resume_headline(documents, tmp_path / "readme.png") == tmp_path / "readme.png"
    finally:
        plot._resume_panel = original
    assert [ax.get_yscale() for ax in shown] == ["linear"] and shown[0].get_ylim()[0] == 0
