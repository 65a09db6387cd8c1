"""How long the garbage collector takes to free a loader whose workers are alive, held in a reference cycle.

A loader held in a reference cycle (an exception kept in a variable holds the frames that hold it) is freed by
Python's cyclic collector. The collector may finalize the ``multiprocessing`` queues of the loader's iterator
before torch's clean-up runs, which then cannot reach its workers and waits its 5 s join timeout for each
(``loaders/_workers.py``). Side by side in one process, interleaved rounds: a plain torch ``DataLoader`` and the
same ``DataLoader`` prepared by this package's ``Accelerator``, each with two persistent workers after one full
pass (``persistent``) or in the middle of a pass without persistent workers (``live pass``), held in a cycle
and let go; what is timed is the ``gc.collect()`` that frees it. Nothing is asserted (the smoke test runs it).

Usage::

    python benchmarks/bench_worker_release.py                 # about 1 to 2 minutes (the stalls themselves)
    python benchmarks/bench_worker_release.py --rounds 1 --workers 1
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from typing import Optional, Sequence

import torch
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader, Dataset

from accelerate_stateful import Accelerator

KINDS = ("plain torch DataLoader", "prepared (accelerate_stateful)")
HOLDS = ("persistent", "live pass")


class Numbers(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> int:
        return index


def release_seconds(kind: str, hold: str, workers: int) -> float:
    """Seconds of the ``gc.collect()`` that frees a loader of ``kind`` held in a cycle as ``hold`` says."""
    loader = DataLoader(Numbers(), batch_size=4, num_workers=workers, persistent_workers=hold == "persistent")
    cycle: dict = {}
    if kind == KINDS[1]:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
        loader = accelerator.prepare(loader)
        cycle["accelerator"] = accelerator
        del accelerator
    if hold == "persistent":
        for _ in loader:
            pass
    else:
        cycle["pass"] = iter(loader)
        next(cycle["pass"])
    cycle["loader"], cycle["self"] = loader, cycle
    del loader, cycle
    start = time.perf_counter()
    gc.collect()
    return time.perf_counter() - start


def run(rounds: int, workers: int) -> dict:
    """Median and best seconds per (kind, hold), over ``rounds`` interleaved rounds (the order rotates)."""
    cases = [(kind, hold) for hold in HOLDS for kind in KINDS]
    times: dict = {case: [] for case in cases}
    gc.collect()
    for round_ in range(rounds):
        for case in cases[round_ % len(cases):] + cases[: round_ % len(cases)]:
            times[case].append(release_seconds(*case, workers))
    return {case: (statistics.median(found), min(found)) for case, found in times.items()}


def table(results: dict, rounds: int, workers: int) -> str:
    lines = [f"{workers} workers, {rounds} interleaved rounds; seconds of the gc.collect() that frees the loader",
             "", "| held in a cycle | loader | s (median) | s (best) | ours / plain (median) |",
             "| --- | --- | --- | --- | --- |"]
    for hold in HOLDS:
        plain = results[(KINDS[0], hold)][0]
        for kind in KINDS:
            median, best = results[(kind, hold)]
            lines.append(f"| {hold} | {kind} | {median:.2f} | {best:.2f} | "
                         f"{median / plain if plain else float('nan'):.3f}x |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(table(run(args.rounds, args.workers), args.rounds, args.workers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
