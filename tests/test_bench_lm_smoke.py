"""The language-model sources benchmark still runs: its functions on tiny sizes (no figure is checked, only that the
resumes it compares are what it says they are)."""

from __future__ import annotations

import math

import pytest
import torch

from scripts import load_script


@pytest.fixture()
def bench():
    return load_script("benchmarks/bench_lm.py", "bench_lm")


def test_the_bare_generator_yields_rows_of_the_format_packed_mixture_yields(bench):
    lm = bench.lm
    sources = lm.token_documents(60, mean_tokens=40)
    ours, bare = list(lm.ours_packed(sources, 32)), list(lm.BarePacked(sources, 32))
    assert len(bare) > 10 and len(ours) > 10
    for rows in (ours, bare):
        assert all(set(row) == {"input_ids", "position_ids"} and row["input_ids"].shape == (32,)
                   and row["position_ids"].dtype == torch.long for row in rows)
    tokens = sum(len(d["input_ids"]) for docs in sources.values() for d in docs)
    assert sum(len(row["input_ids"]) for row in bare) <= tokens


@pytest.mark.timeout(120)
def test_benchmark_functions_run_on_tiny_sizes(bench, tmp_path):
    lm = bench.lm
    files = lm.write_sources(str(tmp_path / "lost"), 600, shards=2)
    lost = bench.bench_lost(files, 50, [300])
    assert [r["pipeline"] for r in lost] == list(lm.RESUME_PIPELINES)
    for row in lost:
        if row["pipeline"] != lm.HF:
            assert row["lost"] == row["repeated"] == 0 and row["exact"] and row["read_again"] > 0

    per_batch = bench.bench_per_batch(lm.token_documents(200, mean_tokens=40), batch_size=2, seq_len=32, batches=3,
                                      rounds=1, workers=[0])
    assert {(r["way"], r["source"]) for r in per_batch} == {
        (way, source) for way in ("read directly", "DataLoader, num_workers=0") for source in (bench.BARE, bench.OURS)}
    assert all(math.isfinite(r["us_per_batch"]) and r["us_per_batch"] > 0 for r in per_batch)

    resume = bench.bench_resume(files, 50, [60, 300], rounds=1)
    assert [r["pipeline"] for r in resume] == list(lm.RESUME_PIPELINES)
    assert all(r["exact"] for r in resume if r["pipeline"] != lm.HF)
    sizes = {"lost": {"documents_per_buffer": 12},
             "per_batch": {"batch_size": 2, "seq_len": 32, "batches": 3, "rounds": 1},
             "resume": {"documents": 600, "rounds": 1, "buffer": 50}}
    report = bench.render({"cpu": "test"}, sizes, lost, per_batch, resume)
    assert "## C. Time from load_state_dict to the first row" in report and "| --- |" in report
