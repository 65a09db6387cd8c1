"""``examples/train.py`` with knobs for the torture and shutdown tests: ``total_limit``, a save window, a failing rank.

Usage::

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 tests/torture_train.py \
        --out DIR --total-limit 1 --save-sleep 0.05 [any examples/train.py option]

Everything but two settings is the example's own code (dataset, loader, the
per-rank JSON-lines stream that ``examples/demo.py`` verifies):

- ``--total-limit``: checkpoints kept (the example keeps 3); with 1, every save
  deletes the previous checkpoint, once the new one is complete.
- ``--save-sleep``: seconds spent inside ``save_state`` (in the ``state_dict()``
  of the object registered for checkpointing, after Accelerate wrote the model
  and optimizer and before the loader states and the manifest), so that a kill
  aimed at a save lands inside one however fast the disk is.
- ``--lr``: the example's 0.05 diverges to NaN after about 90 steps of batch 4,
  and NaN losses never compare equal.
- ``--raise-at-step`` / ``--raise-on-rank``: that rank raises in the middle of
  the epoch, right after logging that step (``test_shutdown.py`` checks that
  the whole job then ends, instead of the other rank waiting in a collective).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import train  # noqa: E402  (examples/train.py)
from accelerate_stateful import Accelerator  # noqa: E402


class SlowProgress(train.Progress):
    """The example's step counter, whose checkpointing takes ``delay`` seconds."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def state_dict(self) -> dict[str, int]:
        time.sleep(self.delay)
        return super().state_dict()


def parse_args(argv: Optional[list[str]] = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    parser.add_argument("--total-limit", type=int, default=1)
    parser.add_argument("--save-sleep", type=float, default=0.0)
    parser.add_argument("--lr", type=float, default=0.05, help="the example's; long runs need less to stay finite")
    parser.add_argument("--raise-at-step", type=int, default=0, help="0: never")
    parser.add_argument("--raise-on-rank", type=int, default=1)
    ours, rest = parser.parse_known_args(argv)
    return ours, train.parse_args(rest)


def main(argv: Optional[list[str]] = None) -> None:
    ours, args = parse_args(argv)
    accelerator = Accelerator(
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
        project_config=ProjectConfiguration(project_dir=str(args.out), automatic_checkpoint_naming=True,
                                            total_limit=ours.total_limit),
    )
    set_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(train.FEATURES, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=ours.lr, momentum=0.9)
    model, optimizer, loader = accelerator.prepare(model, optimizer, train.make_loader(args))
    progress = SlowProgress(ours.save_sleep)
    accelerator.register_for_checkpointing(progress)

    resumed_from = accelerator.resume()
    stream, attempt = train.announce(accelerator, loader, progress, resumed_from, args)
    for epoch in range(loader.epoch, args.epochs):
        for batch in loader:
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            progress.step += 1
            time.sleep(args.sleep)
            train.append(stream, {
                "event": "batch", "attempt": attempt, "rank": accelerator.process_index, "step": progress.step,
                "epoch": epoch, "batch": loader.batches_yielded - 1, "ids": batch["id"].tolist(),
                "loss": loss.item(),
            })
            if progress.step == ours.raise_at_step and accelerator.process_index == ours.raise_on_rank:
                raise RuntimeError(f"rank {ours.raise_on_rank} fails at step {progress.step} (--raise-at-step)")
            if progress.step % args.save_every == 0:
                accelerator.save_state()
    stream.close()
    accelerator.print(f"[torture] done: {progress.step} steps, {args.epochs} epochs")
    accelerator.end_training()


if __name__ == "__main__":
    main()
