"""What carrying the partial gradient of an accumulation window costs in a checkpoint, beside the rest.

One process, CPU: an MLP of about ``--params`` parameters (fp32) with AdamW, windows of 2 micro-steps;
``save_state`` inside the second window (the carry is written) and at its end (no carry). Prints, per size, the bytes of the model, the optimizer state and the carry, and both saves' times.
Per rank the carry is the same under DDP and under FSDP2 inside ``accumulate`` (the unreduced gradient is
whole on every rank); with FSDP2's manual accumulation it is ``1/world`` of it.

    python benchmarks/bench_carry.py --params 10e6 100e6
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader

from accelerate_stateful import Accelerator
from accelerate_stateful.checkpoint._files import human_size

WIDTH = 1024


def measure(params: int, folder: Path) -> dict:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2,
                              dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    layers = max(1, round(params / (WIDTH * WIDTH)))
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters())
    loader = DataLoader(torch.randn(8, WIDTH), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    saves = {}
    for step, batch in enumerate(loader, start=1):  # a whole window first, so AdamW's state exists
        with accelerator.accumulate(model):
            accelerator.backward(model(batch).square().mean())
            optimizer.step()
            optimizer.zero_grad()
        if step in (3, 4):  # inside the second window, then at its end
            name = "inside" if step == 3 else "boundary"
            started = time.perf_counter()
            accelerator.save_state(folder / name)
            saves[name] = time.perf_counter() - started
    inside, boundary = (_sizes(folder / name) for name in ("inside", "boundary"))
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "model": _total(boundary, "model"),
        "optimizer": _total(boundary, "optimizer"),
        "carry": _total(inside, "gradients."),
        "save_inside_s": saves["inside"],
        "save_boundary_s": saves["boundary"],
    }


def _sizes(folder: Path) -> dict:
    return {p.name: p.stat().st_size for p in folder.rglob("*") if p.is_file()}


def _total(sizes: dict, prefix: str) -> int:
    return sum(size for name, size in sizes.items() if name.startswith(prefix))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, nargs="+", default=[10e6, 100e6])
    args = parser.parse_args()
    print("| parameters | model | optimizer | carry (per rank) | save inside a window | save at its boundary |")
    print("| --- | --- | --- | --- | --- | --- |")
    for params in args.params:
        with tempfile.TemporaryDirectory() as tmp:
            r = measure(int(params), Path(tmp))
        print(f"| {r['parameters'] / 1e6:.1f} M | {human_size(r['model'])} | {human_size(r['optimizer'])} | "
              f"{human_size(r['carry'])} | {r['save_inside_s']:.2f} s | {r['save_boundary_s']:.2f} s |")


if __name__ == "__main__":
    main()
