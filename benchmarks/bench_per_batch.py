"""Per-batch cost of a prepared shuffled map-style loader against a bare ``DataLoader``, in one process.

Interleaved epochs (the order alternates every round) of ``--batches`` batches each; prints both medians and
the median of the per-round ratios. To compare two versions of the package, run it in a checkout of each:
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


def _epoch(loader: DataLoader) -> float:
    """Microseconds per batch over one epoch."""
    started, count = time.perf_counter(), 0
    for _ in loader:
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
    times: dict = {"bare": [], "ours": []}
    for round_ in range(args.rounds):
        pair = [("bare", bare), ("ours", ours)]
        for name, loader in pair if round_ % 2 else pair[::-1]:
            times[name].append(_epoch(loader))
    ratios = [o / b for o, b in zip(times["ours"], times["bare"])]
    print(f"bare {statistics.median(times['bare']):.1f} us/batch, ours {statistics.median(times['ours']):.1f} "
          f"us/batch, ours/bare median of the rounds {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
