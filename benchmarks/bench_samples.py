"""What ``accelerate-stateful samples`` costs on a shuffled map-style loader, by how the order is drawn (issue 26).

The checkpoint is written by the real loaders (``ShardDataLoader``, or ``DispatchDataLoader`` with
``--kinds dispatcher``; 2 simulated ranks, batch size 32, ``shuffle=True``) after 500 steps of an epoch of N
samples. Each call is the wall time of ``python -m accelerate_stateful samples CKPT --rank 0 ...`` (a fresh
interpreter, imports included), the minimum of the rounds, the three ways of drawing the epoch's order run one
after another in each round:

- ``now``: what ``samples`` does: the shuffle's loop in Python up to ``PYTHON_SHUFFLE`` samples, above that its
  swaps resolved at once with numpy (``cli/_indices._randperm_numpy``);
- ``Python loop``: the loop in Python at every size, what it did before (up to 1,000,000 samples);
- ``torch``: the loaders themselves (imports torch), as ``samples`` does for a shard loader beyond
  ``_indices.MAX_SAMPLES``; for a dispatcher, what it did at every length before ``cli/_dispatched`` (it runs the
  dispatcher over the dataset's indices), and does now only beyond ``_dispatched.MAX_SAMPLES``.

Every variant must print the same batches.

    python benchmarks/bench_samples.py                           # 50,000, 1,000,000 and 4,000,000 samples, 3 rounds
    python benchmarks/bench_samples.py --sizes 200000 --rounds 5
    python benchmarks/bench_samples.py --kinds dispatcher --sizes 1000000
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from accelerate_stateful import DispatchDataLoader, DistContext, ShardDataLoader
from accelerate_stateful.checkpoint import _files

# Each variant runs the command line as ``python -m accelerate_stateful`` does, after one setting of its own.
VARIANTS = {
    "now": "",
    "Python loop": "import accelerate_stateful.cli._indices as i; i.PYTHON_SHUFFLE = 1 << 62",
    "torch": "import accelerate_stateful.cli._indices as i, accelerate_stateful.cli._dispatched as d; "
             "i.MAX_SAMPLES = d.MAX_SAMPLES = -1",
}
ASKED = {"--step 250": ["--step", "250"], "--remaining": ["--remaining"],
         "--remaining --world-size 3": ["--remaining", "--world-size", "3"]}
KINDS = {"shard": ShardDataLoader, "dispatcher": DispatchDataLoader}
TITLES = {"shard": "a shuffled shard loader", "dispatcher": "a dispatcher over shuffled map-style data"}


def checkpoint(folder: Path, size: int, steps: int = 500, world: int = 2, batch_size: int = 32,
               kind: str = "shard") -> Path:
    for rank in range(world):
        data = DataLoader(range(size), batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(7))
        loader = KINDS[kind].from_dataloader(data, DistContext(rank, world))
        it = iter(loader)
        for _ in range(steps):
            next(it)
        _files.write_loader_state(folder, 0, rank, loader.state_dict())
    _files.write_manifest(folder, world_size=world, num_loaders=1)
    return folder


def call(setting: str, ckpt: Path, asked: list[str]) -> tuple[float, str]:
    code = f"{setting}\nimport sys\nfrom accelerate_stateful.cli._main import main\nsys.exit(main())"
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, "samples", str(ckpt), "--rank", "0", *asked],
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    assert done.returncode == 0, done.stderr
    return wall, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[50_000, 1_000_000, 4_000_000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kinds", nargs="+", choices=list(KINDS), default=["shard"])
    args = parser.parse_args()
    for kind in args.kinds:
        print(f"| `samples` of {TITLES[kind]} | {' | '.join(VARIANTS)} |")
        print(f"| --- |{' --- |' * len(VARIANTS)}")
        table(kind, args.sizes, args.rounds)
        print()


def table(kind: str, sizes: list[int], rounds: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            ckpt = checkpoint(Path(tmp) / f"n{size}", size, kind=kind)
            for name, asked in ASKED.items():
                walls = {variant: [] for variant in VARIANTS}
                for _ in range(rounds):
                    printed = set()
                    for variant, setting in VARIANTS.items():
                        wall, out = call(setting, ckpt, asked)
                        walls[variant].append(wall)
                        printed.add(out)
                    assert len(printed) == 1, f"the variants printed different batches ({size:,}, {name})"
                cells = " | ".join(f"{min(w):.2f} s" for w in walls.values())
                print(f"| {size:,} samples, `{name}` | {cells} |", flush=True)


if __name__ == "__main__":
    main()
