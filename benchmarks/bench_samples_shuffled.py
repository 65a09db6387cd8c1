"""What ``accelerate-stateful samples --step N`` costs on a stream through a ``Shuffled`` buffer (issue 28 §5).

The checkpoint is written by the real loaders (``IterableShardDataLoader``, 2 simulated ranks, batch size 32, no
workers) over ``Shuffled(Mixture(three map-style sources of 1,000,000 documents), buffer_size=10_000)`` after
10,001 steps (640,032 samples drawn); then each asked step is timed as the wall time of ``python -m
accelerate_stateful samples CKPT --rank 0 --step N`` (a fresh interpreter, imports included), the median of the
rounds. Writing the checkpoint takes a minute or two on 2 cores.

    python benchmarks/bench_samples_shuffled.py                  # steps 10000, 5000 and 0, 5 rounds
    python benchmarks/bench_samples_shuffled.py --buffer-size 0  # the Mixture read as it is, no Shuffled
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from torch.utils.data import DataLoader

from accelerate_stateful import DistContext, IterableShardDataLoader, Mixture, Shuffled
from accelerate_stateful.checkpoint import _files


def checkpoint(folder: Path, steps: int, buffer_size: int, world: int = 2, batch_size: int = 32) -> Path:
    size = 1_000_000
    states = []
    for rank in range(world):
        mix = Mixture({"books": range(size), "code": range(size, 2 * size), "web": range(2 * size, 3 * size)},
                      {"books": 1, "code": 2, "web": 5}, seed=11)
        source = Shuffled(mix, buffer_size, seed=3) if buffer_size else mix
        loader = IterableShardDataLoader.from_dataloader(DataLoader(source, batch_size=batch_size),
                                                         DistContext(rank, world))
        it = iter(loader)
        for _ in range(steps):
            next(it)
        states.append(loader.state_dict())
    for rank, state in enumerate(states):
        _files.write_loader_state(folder, 0, rank, state)
    _files.write_manifest(folder, world_size=world, num_loaders=1)
    return folder


def timed(ckpt: Path, step: int, rounds: int) -> float:
    walls = []
    for _ in range(rounds):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "accelerate_stateful", "samples", str(ckpt), "--rank", "0",
                               "--step", str(step)], capture_output=True, text=True)
        walls.append(time.perf_counter() - start)
        assert done.returncode == 0, done.stderr
    return statistics.median(walls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10_001, help="steps taken before the save")
    parser.add_argument("--buffer-size", type=int, default=10_000, help="0: no Shuffled, the Mixture itself")
    parser.add_argument("--ask", type=int, nargs="+", default=[10_000, 5_000, 0], help="the steps asked")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        ckpt = checkpoint(Path(tmp) / "ckpt", args.steps, args.buffer_size)
        print(f"checkpoint written in {time.perf_counter() - start:.0f} s")
        print("| `samples --rank 0 --step N` | wall time (median) |\n| --- | --- |")
        for step in args.ask:
            print(f"| `--step {step}` | {timed(ckpt, step, args.rounds):.2f} s |", flush=True)


if __name__ == "__main__":
    main()
