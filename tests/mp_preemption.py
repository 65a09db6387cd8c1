"""Preemption checkpoints in real processes: where the checkpoint lands, and no collective in a loader's ``next()``.

One launch (2 gloo processes) runs every scenario of ``SCENARIOS`` in turn. Each trains a hand-written loop
with ``accelerator.checkpoint_on_preemption()`` and a prepared learning-rate scheduler three times: without a
signal (the only run of the main-process-only evaluation); with SIGTERM sent to rank 0 only, at a chosen batch (the process exits with 143 after the checkpoint);
and resumed from that checkpoint. Rank 0 writes, per scenario, both runs' final weights (``float.hex``, so
compared bitwise), the preempted run's exit status and the batches the resumed loader had taken, to
``results.json``. The evaluations are the ones issue 25 reported: at the top of every step (after the training
batch was drawn, before it was trained), uneven (``even_batches=False``, 5 samples on 2 ranks: 3 and 2
batches), and on the main process only.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch

from mp_harness_rank import collective_timeout_s, rank, run, set_aside

SCENARIOS = {
    # name: (gradient accumulation steps, the evaluation, the batch at whose top rank 0 gets SIGTERM)
    "eval-at-top-of-step": (1, "even", 3),
    "uneven-eval": (1, "uneven", 4),
    # No signal: a preempted save would be refused, as any save_state() is while a prepared loader stands at
    # different points on the ranks (here: evaluated on rank 0 only); what is checked is that nothing hangs.
    "main-process-only-eval": (1, "main", None),
    "accumulation-signal-inside-window": (2, "even", 5),
}
TRAIN_SAMPLES, BATCH, EPOCHS = 24, 2, 2


def _accelerator(out: Path, ga: int, even_batches: bool):
    from accelerate.state import GradientState
    from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, ProjectConfiguration

    from accelerate_stateful import Accelerator

    GradientState._reset_state()
    return Accelerator(
        cpu=True, gradient_accumulation_steps=ga,
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True, data_seed=0,
                                                  even_batches=even_batches),
        project_config=ProjectConfiguration(project_dir=str(out), automatic_checkpoint_naming=True),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=collective_timeout_s(60)))],
    )


def _evaluate(accelerator, model, loader, kind: str) -> None:
    if kind == "main" and not accelerator.is_main_process:
        return
    with torch.no_grad():
        for batch in loader:
            accelerator.unwrap_model(model)(batch.float().unsqueeze(1))


def train(out: Path, name: str, signal_at: Optional[int] = None) -> dict:
    """One run of scenario ``name``; returns the final weights and the batches the resumed loader had taken."""
    ga, evaluation, _ = SCENARIOS[name]
    accelerator = _accelerator(out, ga, even_batches=evaluation != "uneven")
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    train_dl = torch.utils.data.DataLoader(torch.arange(TRAIN_SAMPLES), batch_size=BATCH, shuffle=True)
    eval_dl = torch.utils.data.DataLoader(torch.arange(5 if evaluation == "uneven" else 4), batch_size=1)
    model, optimizer, scheduler, train_dl, eval_dl = accelerator.prepare(model, optimizer, scheduler, train_dl, eval_dl)
    accelerator.resume()
    taken = train_dl.epoch * len(train_dl) + train_dl.batches_yielded
    accelerator.checkpoint_on_preemption()
    drawn = taken
    try:
        for _ in range(train_dl.epoch, EPOCHS):
            for batch in train_dl:
                drawn += 1
                if drawn == signal_at and rank() == 0:
                    os.kill(os.getpid(), signal.SIGTERM)  # the training batch is drawn, not yet trained
                _evaluate(accelerator, model, eval_dl, evaluation)
                with accelerator.accumulate(model):
                    accelerator.backward(model(batch.float().unsqueeze(1)).square().mean())
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
        weights = [v.hex() for p in accelerator.unwrap_model(model).parameters() for v in p.detach().flatten().tolist()]
        return {"weights": weights, "taken_at_start": taken}
    finally:
        accelerator.free_memory()


def main(root: Path, *names: str) -> None:
    results = {}
    for name in names or SCENARIOS:
        set_aside()
        signal_at = SCENARIOS[name][2]
        found = results[name] = {"reference": train(root / name / "reference", name)}
        if signal_at is None:
            continue
        try:
            train(root / name / "run", name, signal_at)
            found["exit"] = 0
        except SystemExit as stopped:
            found["exit"] = stopped.code
        found["resumed"] = train(root / name / "run", name)
    if rank() == 0:
        (root / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    run(main, Path(sys.argv[1]), *sys.argv[2:])  # scenario names: all by default
