"""What hashing every file of a checkpoint costs: the save with and without it, and checking every byte later.

One process, CPU. Each checkpoint is written by ``Accelerator.save_state``: a model (``model.safetensors``,
at most 512 MB), an SGD optimizer with momentum (``optimizer.bin``, as large as the model) and, for the rest
of the size asked, registered custom objects written by ``torch.save`` (``custom_checkpoint_<i>.pkl``, as
EMA weights would be; at most 1 GB of memory is held for them, however large the checkpoint). Each round
saves once, timing the whole save and the hashing inside it (``_files.hash_share``: every file of the
folder; "without hashing" is the save less that), then times

- ``verify``: ``accelerate-stateful verify CKPT`` (every file's size and SHA-256, every loader state read);
- the load's check: ``_files.verify_files``, what ``load_state``/``resume()`` add before loading anything,
  on one process (the processes sharing a folder split its files between them).

Every file is read right after its save, from the page cache as far as it holds it. Rows give the median
of the rounds; the ratios are to the save without hashing.

    python benchmarks/bench_verify.py                           # 1 GB, 3 rounds (about 30 s on 2 cores)
    python benchmarks/bench_verify.py --sizes 1e9 10e9 --rounds 1 # also 10 GB (several minutes, 10+ GB of disk)
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader

from accelerate_stateful import Accelerator
from accelerate_stateful.checkpoint import _files
from accelerate_stateful.cli._main import main as cli

MODEL_MAX, BLOB_MAX = 512 << 20, 1 << 30


class Blob:
    """A custom object registered for checkpointing; ``torch.save`` writes its tensor whole each time."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def state_dict(self) -> dict:
        return {"tensor": self.tensor}

    def load_state_dict(self, state: dict) -> None:
        self.tensor = state["tensor"]


def build(size: int) -> Accelerator:
    """An accelerator whose ``save_state`` writes about ``size`` bytes."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    width = 1024
    layers = max(1, min(size // 3, MODEL_MAX) // (4 * width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer, _ = accelerator.prepare(model, optimizer, DataLoader(list(range(64)), batch_size=4))
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()  # the momentum buffers exist: the optimizer file is as large as the model's
    optimizer.zero_grad(set_to_none=True)  # no gradient to carry
    rest = size - 2 * 4 * width * width * layers
    if rest > 0:
        blob = torch.rand(min(rest, BLOB_MAX) // 4)
        for _ in range(max(1, round(rest / (blob.numel() * 4)))):
            accelerator.register_for_checkpointing(Blob(blob))
    return accelerator


def _save(accelerator: Accelerator, folder: Path) -> tuple[float, float]:
    """Seconds of the whole save, and of the hashing inside it (the processes' shares of the folder's files)."""
    original, hashing = _files.hash_share, []

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            hashing.append(time.perf_counter() - started)

    _files.hash_share = timed
    try:
        started = time.perf_counter()
        accelerator.save_state(folder)
        return time.perf_counter() - started, sum(hashing)
    finally:
        _files.hash_share = original


def _timed(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def measure(size: int, rounds: int, scratch: Path) -> dict:
    accelerator = build(size)
    times: dict[str, list[float]] = {"with": [], "without": [], "verify": [], "load_check": []}
    total = 0
    for r in range(rounds):
        folder = scratch / f"ckpt_{r}"
        save, hashing = _save(accelerator, folder)
        times["with"].append(save)
        times["without"].append(save - hashing)
        total = sum(e["size"] for e in _files.load_manifest(folder)["files"].values())
        status = []
        times["verify"].append(_timed(lambda: status.append(cli(["verify", str(folder)]))))
        if status != [0]:
            raise RuntimeError(f"verify answered {status} on a fresh checkpoint")
        manifest = _files.load_manifest(folder)
        times["load_check"].append(_timed(lambda: _files.verify_files(folder, manifest)))
        shutil.rmtree(folder)
    median = {k: statistics.median(v) for k, v in times.items()}
    return {"bytes": total, **median}


def table(results: list[dict]) -> str:
    lines = ["| checkpoint | save without hashing | save with hashing | ratio | verify | ratio | load's check | "
             "ratio | hashed |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        base = r["without"]
        lines.append(
            f"| {_files.human_size(r['bytes'])} | {base:.2f} s | {r['with']:.2f} s | {r['with'] / base:.2f}x | "
            f"{r['verify']:.2f} s | {r['verify'] / base:.2f}x | {r['load_check']:.2f} s | "
            f"{r['load_check'] / base:.2f}x | {r['bytes'] / r['load_check'] / 1e9:.2f} GB/s |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e9], help="checkpoint sizes in bytes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write the checkpoints (default: a temp dir)")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    results = []
    for size in args.sizes:
        with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
            results.append(measure(int(size), args.rounds, Path(scratch)))
        print(table(results[-1:]), flush=True)
    text = table(results)
    print(f"\n{text}")
    if args.markdown is not None:
        args.markdown.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
