"""The pipeline-randomness benchmark still runs: tiny sizes, only that it reports a figure per contender."""

from __future__ import annotations

from scripts import load_script


def test_the_pipeline_rng_benchmark_reports_every_mode_against_the_bare_loader(tmp_path, monkeypatch):
    bench = load_script("benchmarks/bench_pipeline_rng.py", "bench_pipeline_rng")
    monkeypatch.setattr(bench, "QUICK_SIZES", {0: (256, 1)})
    out = tmp_path / "bench.md"
    assert bench.main(["--quick", "--markdown", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    for name in [bench.BARE] + [f"pipeline_rng={mode}" for mode in bench.MODES]:
        assert f"| {name} | " in text
    assert "Per sample" in text
