"""What ``accelerate-stateful samples`` costs on a shuffled map-style loader, by how the order is drawn (issue 26).

The checkpoint is written by the real loaders (``ShardDataLoader``, 2 simulated ranks, batch size 32,
``shuffle=True``) after 500 steps of an epoch of N samples. Each call is the wall time of ``python -m
accelerate_stateful samples CKPT --rank 0 ...`` (a fresh interpreter, imports included), the minimum of the
rounds, the three ways of drawing the epoch's order run one after another in each round:

- ``now``: what ``samples`` does: the shuffle's loop in Python up to ``PYTHON_SHUFFLE`` samples, above that its
  swaps resolved at once with numpy (``cli/_indices._randperm_numpy``);
- ``Python loop``: the loop in Python at every size, what it did before (up to 1,000,000 samples);
- ``torch``: the loaders themselves, as ``samples`` does beyond ``MAX_SAMPLES`` (imports torch).

Every variant must print the same batches.

    python benchmarks/bench_samples.py                           # 50,000, 1,000,000 and 4,000,000 samples, 3 rounds
    python benchmarks/bench_samples.py --sizes 200000 --rounds 5
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

from accelerate_stateful import DistContext, ShardDataLoader
from accelerate_stateful.checkpoint import _files

# Each variant runs the command line as ``python -m accelerate_stateful`` does, after one setting of its own.
VARIANTS = {
    "now": "",
    "Python loop": "import accelerate_stateful.cli._indices as i; i.PYTHON_SHUFFLE = 1 << 62",
    "torch": "import accelerate_stateful.cli._indices as i; i.MAX_SAMPLES = -1",
}
ASKED = {"--step 250": ["--step", "250"], "--remaining": ["--remaining"],
         "--remaining --world-size 3": ["--remaining", "--world-size", "3"]}


def checkpoint(folder: Path, size: int, steps: int = 500, world: int = 2, batch_size: int = 32) -> Path:
    for rank in range(world):
        data = DataLoader(range(size), batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(7))
        loader = ShardDataLoader.from_dataloader(data, DistContext(rank, world))
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
    args = parser.parse_args()
    print(f"| `samples` of a shuffled shard loader | {' | '.join(VARIANTS)} |")
    print(f"| --- |{' --- |' * len(VARIANTS)}")
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            ckpt = checkpoint(Path(tmp) / f"n{size}", size)
            for name, asked in ASKED.items():
                walls = {variant: [] for variant in VARIANTS}
                for _ in range(args.rounds):
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
