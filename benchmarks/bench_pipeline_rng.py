"""Per-batch cost of reproducing pipeline randomness (``Accelerator(pipeline_rng=...)``) against a bare DataLoader.

Full epochs over a map-style dataset whose ``__getitem__`` draws nothing (``range(n)`` as Python ints,
``batch_size=32``, ``shuffle=True``), so the figures are the loaders' own overhead, the worst case for
a per-batch or per-sample addition. Contenders, interleaved round by round (their order rotates every
round), median over the rounds kept: the bare ``DataLoader`` and our shard loader with each
``pipeline_rng`` mode (``off``, ``auto`` the default, ``batch``, ``sample``). Once with
``num_workers=0``, once with ``2``. The per-sample figure is (``sample`` - ``off``) / batch size.

Usage::

    python benchmarks/bench_pipeline_rng.py            # about a minute on 2 cores
    python benchmarks/bench_pipeline_rng.py --quick    # a few seconds, smaller sizes
    python benchmarks/bench_pipeline_rng.py --markdown docs/bench_rng.md

No figure here is asserted anywhere; ``tests/test_bench_smoke.py`` runs it with tiny sizes.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any, Callable, Optional, Sequence

import torch
from torch.utils.data import DataLoader

from accelerate_stateful import DistContext, ShardDataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when a test loads this file
from _common import no_gc, rotated, run_main, table  # noqa: E402

BATCH, SEED = 32, 1234
BARE = "DataLoader (bare)"
MODES = ("off", "auto", "batch", "sample")
FULL_SIZES = {0: (100_000, 9), 2: (40_000, 7)}
QUICK_SIZES = {0: (20_000, 3), 2: (8_000, 3)}


def build(name: str, samples: int, workers: int) -> Any:
    user = DataLoader(range(samples), batch_size=BATCH, shuffle=True, num_workers=workers,
                      generator=torch.Generator().manual_seed(SEED))
    if name == BARE:
        return user
    return ShardDataLoader.from_dataloader(user, DistContext(0, 1), pipeline_rng=name.split("=")[1])


def time_epoch(loader: Any) -> tuple[float, int]:
    with no_gc():
        started, count = time.perf_counter(), 0
        for _ in loader:
            count += 1
        return time.perf_counter() - started, count


def bench(sizes: dict) -> dict[int, dict[str, float]]:
    """Median microseconds per batch, per worker count and contender."""
    names = [BARE] + [f"pipeline_rng={mode}" for mode in MODES]
    figures: dict[int, dict[str, float]] = {}
    for workers, (samples, rounds) in sizes.items():
        loaders = {name: build(name, samples, workers) for name in names}
        times: dict[str, list[float]] = {name: [] for name in names}
        for round_index in range(rounds):
            for name in rotated(names, round_index):
                seconds, batches = time_epoch(loaders[name])
                times[name].append(1e6 * seconds / batches)
        figures[workers] = {name: statistics.median(values) for name, values in times.items()}
    return figures


def report(figures: dict[int, dict[str, float]]) -> Callable[[dict], str]:
    def render(env: dict) -> str:
        lines = ["## Machine", "", *table(["", ""], [[k, str(v)] for k, v in env.items()])]
        for workers, row in figures.items():
            bare = row[BARE]
            per_sample = (row["pipeline_rng=sample"] - row["pipeline_rng=off"]) / BATCH
            lines += ["", f"## num_workers={workers} (batch_size={BATCH}, a dataset drawing nothing)", "",
                      *table(["loader", "µs / batch (median)", "vs bare"],
                             [[name, f"{us:.1f}", f"{us / bare:.2f}x"] for name, us in row.items()]),
                      "", f"Per sample (`sample` - `off`) / {BATCH}: {per_sample:.2f} µs."]
        return "\n".join(lines) + "\n"
    return render


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_main(argv, __doc__, "a few seconds", (QUICK_SIZES, FULL_SIZES),
                    lambda sizes, started: _measure(sizes))


def _measure(sizes: dict) -> tuple[Callable[[dict], str], dict]:
    """The report's renderer and the results (µs per batch by worker count and loader, for ``--json``)."""
    figures = bench(sizes)
    return report(figures), {"per_batch_us": {str(workers): row for workers, row in figures.items()}}


if __name__ == "__main__":
    sys.exit(main())
