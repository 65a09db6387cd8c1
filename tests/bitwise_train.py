"""A training run that must end bitwise equal to itself however often it is SIGKILLed and restarted.

Usage (the same command after every kill)::

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 tests/bitwise_train.py \
        --out DIR --kill-plan 5,13

Three independent training runs are multiplexed in one process, so one launch
covers three configurations: run ``w0`` reads its data with
``DataLoader(batch_size=..., shuffle=True, num_workers=0)``, run ``w2`` the same
with ``num_workers=2``, and run ``bs2`` through a user's own
``batch_sampler=Bucketed(...)`` (length bucketing, prepared as
``BatchSamplerDataLoader``) with ``num_workers=2``. Each is a small MLP with
dropout, AdamW, a linear LR schedule, ``gradient_accumulation_steps=2`` and
``clip_grad_norm_``, over a dataset whose ``__getitem__`` draws augmentation
from ``torch``, ``random`` and ``numpy``. A checkpoint is saved every
``--save-every`` micro-steps (odd by default, so every other checkpoint falls
between the two micro-steps of a window).

``--kill-plan`` lists micro-steps at which every rank SIGKILLs itself, each
once: a process starts by reading which kills already happened (a marker file
per kill) and dies at the first one that has not. Each rank appends one JSON
line per micro-step and run to ``<out>/log_rank<r>.jsonl`` (the loss as
``float.hex``), preceded by a start record saying what it resumed from, whether
that checkpoint held a pending gradient and which loader class each run was
prepared as; at the end it writes every run's weights and optimizer states to
``<out>/final_rank<r>.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
from pathlib import Path

import numpy as np
import torch
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
from torch.utils.data import DataLoader, Dataset, Sampler

from accelerate_stateful import Accelerator
from accelerate_stateful.training import _accumulation

FEATURES, ACCUMULATION = 8, 2
RUNS = {"w0": 0, "w2": 2, "bs2": 2}  # run: num_workers; ``bs2`` reads through ``Bucketed``


class Augmented(Dataset):
    """Fixed features and targets, with noise drawn at every fetch from all three global RNGs."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(7)
        self.x = torch.randn(size, FEATURES, generator=generator)
        self.y = self.x.sum(dim=1, keepdim=True) + torch.randn(size, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict:
        noise = 0.1 * torch.randn(FEATURES) + 0.01 * random.random() + 0.01 * float(np.random.standard_normal())
        return {"id": index, "x": self.x[index] + noise, "y": self.y[index]}


class Bucketed(Sampler[list[int]]):
    """Length bucketing as users write it: ids sorted by a made-up length, cut into batches, the batches shuffled
    per epoch from ``set_epoch`` (no state of its own: the package draws each epoch's batches again)."""

    def __init__(self, size: int, batch_size: int) -> None:
        self.batch_size, self.epoch = batch_size, 0
        self.order = sorted(range(size), key=lambda i: ((i * 7) % 5, i))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return -(-len(self.order) // self.batch_size)

    def __iter__(self):
        batches = [self.order[i:i + self.batch_size] for i in range(0, len(self.order), self.batch_size)]
        random.Random(self.epoch).shuffle(batches)
        return iter(batches)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kill-plan", default="", help="comma-separated micro-steps to die at, each once")
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save-every", type=int, default=3)
    return parser.parse_args()


def build(accelerator: Accelerator, args: argparse.Namespace, name: str, total_steps: int) -> tuple:
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.1, 1 - s / total_steps))
    dataset = Augmented(args.samples)
    if name == "bs2":
        loader = DataLoader(dataset, batch_sampler=Bucketed(args.samples, args.batch_size), num_workers=RUNS[name])
    else:
        loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=RUNS[name])
    return accelerator.prepare(model, optimizer, scheduler, loader)


def pending_kill(out: Path, plan: list[int]) -> int:
    """The first micro-step of the plan whose kill has not happened yet (read once, at start), or -1."""
    return next((step for step in plan if not (out / f"killed_at_{step}").exists()), -1)


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    plan = [int(s) for s in args.kill_plan.split(",") if s]
    die_at = pending_kill(args.out, plan)
    accelerator = Accelerator(
        gradient_accumulation_steps=ACCUMULATION,
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
        project_config=ProjectConfiguration(project_dir=str(args.out), automatic_checkpoint_naming=True,
                                            total_limit=2),
    )
    set_seed(0)
    steps_per_epoch = -(-args.samples // (args.batch_size * accelerator.num_processes))
    total = args.epochs * steps_per_epoch
    runs = {name: build(accelerator, args, name, total) for name in RUNS}
    progress = {"step": 0}

    class Progress:
        def state_dict(self) -> dict:
            return dict(progress)

        def load_state_dict(self, state: dict) -> None:
            progress.update(state)

    accelerator.register_for_checkpointing(Progress())
    resumed = accelerator.resume()
    pending = resumed is not None and _accumulation.gradient_file(resumed, accelerator.process_index).exists()
    log = open(args.out / f"log_rank{accelerator.process_index}.jsonl", "a")
    loaders = {name: run[3] for name, run in runs.items()}
    log.write(json.dumps({"start": str(resumed), "pending_gradients": pending, "at": progress["step"],
                          "loaders": {name: type(dl).__name__ for name, dl in loaders.items()}}) + "\n")
    log.flush()
    first = loaders["w0"]
    for _ in range(first.epoch, args.epochs):
        iterators = {name: iter(dl) for name, dl in loaders.items()}
        for batch0 in iterators["w0"]:
            batches = {"w0": batch0, **{name: next(iterators[name]) for name in iterators if name != "w0"}}
            with accelerator.accumulate(*(run[0] for run in runs.values())):
                losses = {name: train_step(accelerator, runs[name], batches[name]) for name in runs}
            progress["step"] += 1
            step = progress["step"]
            for name, loss in losses.items():
                log.write(json.dumps({"step": step, "run": name, "loss": loss,
                                      "ids": batches[name]["id"].tolist()}) + "\n")
            log.flush()
            if step % args.save_every == 0:
                accelerator.save_state()
            if step == die_at:
                if accelerator.is_main_process:
                    (args.out / f"killed_at_{step}").touch()
                os.kill(os.getpid(), signal.SIGKILL)
        if any(next(iterators[name], None) is not None for name in iterators if name != "w0"):
            raise RuntimeError("the runs' loaders went out of step")
    final = {name: {"model": accelerator.unwrap_model(run[0]).state_dict(), "optimizer": run[1].state_dict()}
             for name, run in runs.items()}
    torch.save(final, args.out / f"final_rank{accelerator.process_index}.pt")
    accelerator.end_training()


def train_step(accelerator: Accelerator, run: tuple, batch: dict) -> str:
    model, optimizer, scheduler, _ = run
    loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
    accelerator.backward(loss)
    if accelerator.sync_gradients:
        accelerator.clip_grad_norm_(model.parameters(), 0.5)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return float(loss.detach()).hex()


if __name__ == "__main__":
    import mp_harness_rank

    mp_harness_rank.run(main)
