"""A small training script that can be killed at any moment and restarted with the same command.

Launch it with Accelerate (two CPU processes on gloo shown here)::

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 examples/train.py --out runs/demo

Kill it (``kill -9`` the whole job) and run the same command again: it resumes
from the newest complete checkpoint under ``<out>/checkpoints`` and every rank
continues with exactly the batches it would have seen had nothing happened.
Run it again with another ``--num_processes`` (and ``--num-workers``) instead,
and the rest of the interrupted epoch is dealt out to the new processes, each
sample not yet trained exactly once; later epochs are those of a fresh run on
that many processes.

Besides training, each rank appends one JSON line per batch to
``<out>/stream_rank<r>.jsonl`` (global step, epoch, batch index in the epoch,
the sample ids of the batch, the loss), preceded by one ``"start"`` record per
process start. ``examples/demo.py`` compares these streams with those of an
uninterrupted run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional, TextIO

import torch
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
from torch.utils.data import DataLoader, Dataset

from accelerate_stateful import Accelerator

FEATURES = 8
# Records are written by json.dumps with "event" first, so a start record begins with this.
START_PREFIX = '{"event": "start"'


class IdDataset(Dataset):
    """A map-style regression dataset whose items carry their own sample id.

    Args:
        size: Number of samples.
        seed: Seed of the (fixed) features and targets.
    """

    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, FEATURES, generator=generator)
        true_weight = torch.randn(FEATURES, 1, generator=generator)
        self.y = self.x @ true_weight + 0.1 * torch.randn(size, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"id": index, "x": self.x[index], "y": self.y[index]}


class Progress:
    """The global step, saved in every checkpoint next to the model (``register_for_checkpointing``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="project dir: checkpoints and batch streams")
    parser.add_argument("--num-workers", type=int, default=2, help="data-loading workers per process")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--save-every", type=int, default=4, help="checkpoint every N global steps")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds of simulated compute per step")
    parser.add_argument("--samples", type=int, default=300, help="dataset size")
    parser.add_argument("--batch-size", type=int, default=7, help="samples per batch per process")
    parser.add_argument("--seed", type=int, default=1234)
    return parser.parse_args(argv)


def open_stream(path: Path) -> tuple[TextIO, int]:
    """Open this rank's stream for appending; returns the file and this process start's attempt number."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text("utf-8") if path.exists() else ""
    attempt = sum(1 for line in text.splitlines() if line.startswith(START_PREFIX))
    stream = path.open("a", encoding="utf-8")
    if text and not text.endswith("\n"):
        # A kill can cut the last line short; end it so the next record starts on its own line.
        stream.write("\n")
    return stream, attempt


def append(stream: TextIO, record: dict[str, Any]) -> None:
    """Write one record and make it durable before the next checkpoint can be taken."""
    stream.write(json.dumps(record) + "\n")
    stream.flush()
    os.fsync(stream.fileno())


def make_loader(args: argparse.Namespace) -> DataLoader:
    """A plain shuffled ``DataLoader``, written as for any Accelerate script; ``prepare`` makes it resumable."""
    return DataLoader(
        IdDataset(args.samples, args.seed),
        batch_size=args.batch_size,
        shuffle=True,
        # The loader's seed fixes every epoch's order; a restart draws the same orders from it.
        generator=torch.Generator().manual_seed(args.seed),
        num_workers=args.num_workers,
    )


def announce(accelerator: Accelerator, loader: Any, progress: Progress, resumed_from: Optional[Path],
             args: argparse.Namespace) -> tuple[TextIO, int]:
    """Say where this process starts, on screen and in this rank's stream; returns the stream and attempt."""
    rank = accelerator.process_index
    stream, attempt = open_stream(args.out / f"stream_rank{rank}.jsonl")
    append(stream, {
        "event": "start", "attempt": attempt, "rank": rank, "world_size": accelerator.num_processes,
        "resumed_from": None if resumed_from is None else resumed_from.name,
        "step": progress.step, "epoch": loader.epoch, "batch": loader.batches_yielded,
        "batches_per_epoch": len(loader), "dataset_size": len(loader.dataset),
    })
    if resumed_from is None:
        accelerator.print(f"[train] fresh start: no complete checkpoint under {args.out / 'checkpoints'}")
    else:
        accelerator.print(
            f"[train] resumed from {resumed_from.name}: epoch {loader.epoch}, batch {loader.batches_yielded} "
            f"of {len(loader)}, global step {progress.step}"
        )
    return stream, attempt


def show_package_log(accelerator: Accelerator) -> None:
    """Print the package's lines on the main process: where each resume starts, and a change of world size."""
    if accelerator.is_main_process:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s] %(levelname)s: %(message)s"))
        package = logging.getLogger("accelerate_stateful")
        package.addHandler(handler)
        package.setLevel(logging.INFO)


def main(argv: Optional[list[str]] = None) -> None:
    run(parse_args(argv))


def run(args: argparse.Namespace, *, total_limit: int = 3, lr: float = 0.05, progress: Optional[Progress] = None,
        after_step: Callable[[Accelerator, int], None] = lambda accelerator, step: None) -> None:
    """Train, resuming from the newest complete checkpoint; ``after_step`` runs after each step is logged."""
    accelerator = Accelerator(
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
        project_config=ProjectConfiguration(project_dir=str(args.out), automatic_checkpoint_naming=True,
                                            total_limit=total_limit),
    )
    show_package_log(accelerator)
    set_seed(args.seed)  # the model's initial weights; a restart loads the trained ones over them
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model, optimizer, loader = accelerator.prepare(model, optimizer, make_loader(args))
    progress = progress if progress is not None else Progress()
    accelerator.register_for_checkpointing(progress)

    resumed_from = accelerator.resume()  # the newest complete checkpoint, or None on a fresh start
    stream, attempt = announce(accelerator, loader, progress, resumed_from, args)
    for epoch in range(loader.epoch, args.epochs):
        for batch in loader:
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            progress.step += 1
            time.sleep(args.sleep)
            # Logged before the checkpoint: a kill between the two makes the restart train this step again.
            append(stream, {
                "event": "batch", "attempt": attempt, "rank": accelerator.process_index, "step": progress.step,
                "epoch": epoch, "batch": loader.batches_yielded - 1, "ids": batch["id"].tolist(),
                "loss": loss.item(),
            })
            after_step(accelerator, progress.step)
            if progress.step % args.save_every == 0:
                accelerator.save_state()
    stream.close()
    accelerator.print(f"[train] done: {progress.step} steps, {args.epochs} epochs")
    accelerator.end_training()


if __name__ == "__main__":
    main()
