"""Per-batch cost of a prepared shuffled map-style loader against a bare ``DataLoader``, in one process.

Interleaved epochs (the order alternates every round) of ``--batches`` batches each; prints the medians and
the medians of the per-round ratios. Three loaders: the bare ``DataLoader``; the same bare loader read as ours
reads its base loader, without torch's per-batch profiler annotation (``loaders/_torch_iter``), which isolates
the package's own work; and ours. To compare two versions of the package, run it in a checkout of each:
``git worktree add /tmp/old <commit> && cd /tmp/old && PYTHONPATH=$PWD python benchmarks/bench_per_batch.py``.
No test checks a timing; ``tests/test_per_batch_cost.py`` bounds the calls per batch instead.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader

from accelerate_stateful import Accelerator
from accelerate_stateful.loaders._torch_iter import batches_of


def _epoch(loader: DataLoader, unannotated: bool = False) -> float:
    """Microseconds per batch over one epoch."""
    started, count = time.perf_counter(), 0
    for _ in batches_of(iter(loader)) if unannotated else loader:
        count += 1
    return (time.perf_counter() - started) / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=2000, help="batches per epoch (default 2000)")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = list(range(args.batches * 32))
    bare = DataLoader(data, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    ours = accelerator.prepare(DataLoader(data, batch_size=32, shuffle=True,
                                          generator=torch.Generator().manual_seed(0)))
    gc.collect()
    gc.freeze()
    times: dict = {"bare": [], "unannotated": [], "ours": []}
    for round_ in range(args.rounds):
        runs = [("bare", bare, False), ("unannotated", bare, True), ("ours", ours, False)]
        for name, loader, unannotated in runs if round_ % 2 else runs[::-1]:
            times[name].append(_epoch(loader, unannotated))

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(times[a], times[b]))

    print(f"bare {statistics.median(times['bare']):.1f} us/batch, bare unannotated "
          f"{statistics.median(times['unannotated']):.1f} us/batch, ours {statistics.median(times['ours']):.1f} "
          f"us/batch, ours/bare median of the rounds {ratio('ours', 'bare'):.3f}, ours/bare unannotated "
          f"{ratio('ours', 'unannotated'):.3f}")


if __name__ == "__main__":
    main()
