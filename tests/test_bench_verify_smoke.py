"""The hashing benchmark still runs: a checkpoint of a few MB, one round, only that it reports its ratios."""

from __future__ import annotations

from scripts import load_script


def test_the_hashing_benchmark_reports_save_and_verify_times_as_ratios(tmp_path):
    bench = load_script("benchmarks/bench_verify.py", "bench_verify")
    out = tmp_path / "bench.md"
    assert bench.main(["--sizes", "6e6", "--rounds", "1", "--dir", str(tmp_path), "--markdown", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    assert "| save without hashing | save with hashing | ratio | verify |" in text
    assert text.count("x |") == 3
