"""What ``accelerate-stateful samples --step N`` costs on a stream through a ``Shuffled`` buffer (issue 28 §5).

The checkpoint is written by the real loaders (``IterableShardDataLoader``, 2 simulated ranks, batch size 32, no
workers) over ``Shuffled(Mixture(three map-style sources of 1,000,000 documents), buffer_size=10_000)`` after
10,001 steps (640,032 samples drawn); then each asked step is timed as the wall time of ``python -m
accelerate_stateful samples CKPT --rank 0 --step N`` (a fresh interpreter, imports included), the median of the
rounds. Writing the checkpoint takes a minute or two on 2 cores.

    python benchmarks/bench_samples_shuffled.py                  # steps 10000, 5000 and 0, 5 rounds
    python benchmarks/bench_samples_shuffled.py --buffer-size 0  # the Mixture read as it is, no Shuffled
    python benchmarks/bench_samples_shuffled.py --buffer-size 0 --packed 128   # Packed(Mixture), rows of 128
    python benchmarks/bench_samples_shuffled.py --buffer-size 0 --filtered     # Filtered(Mixture), 4 of 7 kept
    python benchmarks/bench_samples_shuffled.py --buffer-size 0 --packed 128 --filtered  # Packed(Filtered(Mixture))

With ``--packed`` each source's document ``i`` is ``1 + i % 97`` tokens, the rows are packed from the mixture
(``Packed(Mixture(...), seq_len)``), and ``samples`` names each step's pieces of documents from the marks the
packer's shares noted at each batch's end; the size of one rank's saved state is printed too. With
``--filtered`` the rows are the mixture's items that :func:`four_of_seven` keeps (``Filtered(Mixture(...))``),
and ``samples`` names the items each step drew from the marks the filter's shares noted. With both, the
documents :func:`four_of_seven` keeps are packed (``Packed(Filtered(Mixture(...)), seq_len)``), and
``samples`` names each step's documents by the source items the filter drew, from the packer's marks.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

from accelerate_stateful import DistContext, Filtered, IterableShardDataLoader, Mixture, Packed, Shuffled
from accelerate_stateful.checkpoint import _files


class Documents:
    """Map-style: document ``i`` is ``1 + i % 97`` tokens, each the document's number."""

    def __init__(self, size: int, base: int) -> None:
        self.size, self.base = size, base

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> list[int]:
        return [self.base + i] * (1 + i % 97)


def four_of_seven(item: Any) -> bool:
    """Keeps 4 of every 7 items (drops 3 in 7, about 43 %): of the numbers, or of the documents by their number."""
    return (item[0] if isinstance(item, list) else item) % 7 < 4


def checkpoint(folder: Path, steps: int, buffer_size: int, world: int = 2, batch_size: int = 32,
               packed: int = 0, filtered: bool = False) -> Path:
    size = 1_000_000
    states = []
    for rank in range(world):
        if packed:
            data = {"books": Documents(size, 0), "code": Documents(size, size), "web": Documents(size, 2 * size)}
        else:
            data = {"books": range(size), "code": range(size, 2 * size), "web": range(2 * size, 3 * size)}
        mix = Mixture(data, {"books": 1, "code": 2, "web": 5}, seed=11)
        source = Shuffled(mix, buffer_size, seed=3) if buffer_size else mix
        source = Filtered(source, four_of_seven) if filtered else source
        source = Packed(source, packed) if packed else source
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
    parser.add_argument("--packed", type=int, default=0, help="pack the rows: their seq_len (0: not packed)")
    parser.add_argument("--filtered", action="store_true",
                        help="rows: the items a filter keeps; with --packed, the documents it keeps, packed")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        ckpt = checkpoint(Path(tmp) / "ckpt", args.steps, args.buffer_size, packed=args.packed,
                          filtered=args.filtered)
        print(f"checkpoint written in {time.perf_counter() - start:.0f} s; one rank's loader state: "
              f"{sum(map(len, _files.encode_state(_files.read_loader_state(ckpt, 0, 0)).values())):,} bytes")
        print("| `samples --rank 0 --step N` | wall time (median) |\n| --- | --- |")
        for step in args.ask:
            print(f"| `--step {step}` | {timed(ckpt, step, args.rounds):.2f} s |", flush=True)


if __name__ == "__main__":
    main()
