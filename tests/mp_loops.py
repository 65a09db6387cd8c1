"""Everyday loops in real processes, run inside the ``world2`` and ``world3`` launches of ``mp_scenarios.py``.

Two scripts, each written as a user writes it, each run uninterrupted and then resumed (in a fresh
``Accelerator``, model, optimizer and loaders, with ``load_state`` from real files) at every one of its
checkpoints and once more from a checkpoint a resumed run wrote; every rank's log must equal its log of
the uninterrupted run:

- ``classic``: Accelerate's ``examples/complete_nlp_example.py`` recipe: ``step_{N}`` checkpoints every 2
  steps (so also at every epoch boundary), ``starting_epoch = N // len(dl)``,
  ``accelerator.skip_first_batches(dl, N % len(dl))``, no ``set_epoch``;
- ``everyday``: a warm-up ``next(iter(dl))`` after loading, ``zip`` with a longer loader, a ``break``
  after 4 batches per epoch (no ``set_epoch``), and an evaluation stopped after 2 batches every other step;
  checkpoints mid-epoch and after each epoch's inner loop;
- ``late-eval``: ``everyday`` with its evaluation loader prepared after ``load_state`` (in every run, so
  last), which takes the position the checkpoint saved for it then.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from accelerate.state import GradientState
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader

import accelerate_stateful

EPOCHS = 3
LOOP_IDS = ["loops-classic-recipe", "loops-everyday", "loops-late-eval"]


def _loader(n: int, bs: int, seed: int) -> DataLoader:
    return DataLoader(list(range(n)), batch_size=bs, shuffle=True, generator=torch.Generator().manual_seed(seed))


class _Run:
    """One process's run: a fresh Accelerator, model, optimizer and loaders, optionally loaded from a checkpoint."""

    def __init__(self, loaders: list[tuple[int, int, int]], resume_from: Path = None, late: tuple = ()) -> None:
        GradientState._reset_state()
        self.acc = accelerate_stateful.Accelerator(
            cpu=True, gradient_accumulation_steps=2,
            dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
        model = torch.nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        early = [i for i in range(len(loaders)) if i not in late]  # the loaders ``late`` prepared after the load
        self.model, self.optimizer, *prepared = self.acc.prepare(model, optimizer,
                                                                 *(_loader(*loaders[i]) for i in early))
        if resume_from is not None:
            self.acc.load_state(resume_from)
        prepared += [self.acc.prepare(_loader(*loaders[i])) for i in late]
        self.loaders = [prepared[(early + list(late)).index(i)] for i in range(len(loaders))]

    def train(self, batch: torch.Tensor) -> None:
        with self.acc.accumulate(self.model):
            self.acc.backward(self.model(batch.float().unsqueeze(1) / 100).pow(2).mean())
            self.optimizer.step()
            self.optimizer.zero_grad()


def classic(run: _Run, log: list, save: Callable[[str], None], resume_step: int = None) -> None:
    (train_dl,) = run.loaders
    overall_step, starting_epoch = 0, 0
    if resume_step is not None:
        starting_epoch = resume_step // len(train_dl)
        resume_step -= starting_epoch * len(train_dl)
    for epoch in range(starting_epoch, EPOCHS):
        if resume_step is not None and epoch == starting_epoch:
            active = run.acc.skip_first_batches(train_dl, resume_step)
            overall_step += resume_step + starting_epoch * len(train_dl)
        else:
            active = train_dl
        for batch in active:
            run.train(batch)
            log.append((epoch, batch.tolist()))
            overall_step += 1
            if overall_step % 2 == 0:
                save(f"step_{overall_step}")


def everyday(run: _Run, log: list, save: Callable[[str], None], resume_step: int = None) -> None:
    train_dl, eval_dl, long_dl = run.loaders
    next(iter(train_dl))  # a warm-up batch (a shape check): changes nothing
    for epoch in range(train_dl.epoch, EPOCHS):
        for batch, extra in zip(train_dl, long_dl):
            run.train(batch)
            log.append((epoch, batch.tolist(), extra.tolist()))
            if train_dl.batches_yielded >= 4:  # max steps per epoch
                break
            if train_dl.batches_yielded % 2:
                for i, eval_batch in enumerate(eval_dl):  # max_eval_steps=2
                    log.append(("eval", eval_batch.tolist(), eval_dl.end_of_dataloader))
                    if i == 1:
                        break
            if train_dl.batches_yielded == 2:
                save(f"in_{len(log)}")
        log.append(("after", epoch))
        save(f"after_{len(log)}")


SCRIPTS = {  # script, loaders, the loaders prepared after load_state
    "loops-classic-recipe": (classic, [(27, 3, 1)], ()),
    "loops-everyday": (everyday, [(41, 2, 2), (23, 2, 3), (97, 2, 4)], ()),
    "loops-late-eval": (everyday, [(41, 2, 2), (23, 2, 3), (97, 2, 4)], (1,)),
}


def run_loop_case(case: str, root: Path, add: Callable[[str], None]) -> int:
    """Run one script uninterrupted, then resumed at each checkpoint and once more from a resumed run's; returns
    how many resumed runs were compared. Differences are reported through ``add``."""
    script, loaders, late = SCRIPTS[case]
    saved: list[tuple[Path, int, int]] = []  # (folder, log length, step)

    def saver(run: _Run, log: list, into: list, prefix: str) -> Callable[[str], None]:
        def save(name: str) -> None:
            folder = root / f"{prefix}{name}"
            run.acc.save_state(folder)
            step = int(name.split("_")[1]) if name.startswith("step_") else None
            into.append((folder, len(log), step))
        return save

    reference: list = []
    run = _Run(loaders, late=late)
    script(run, reference, saver(run, reference, saved, "ref-"))
    compared = 0
    for index, (folder, at, step) in enumerate(saved):
        log, again, chain = reference[:at], [], index == len(saved) // 2
        run = _Run(loaders, resume_from=folder, late=late)
        script(run, log, saver(run, log, again, f"r{index}-") if chain else lambda name: None, resume_step=step)
        compared += 1
        if log != reference:
            add(f"{case}: resumed from {folder.name} differs at entry {_first_difference(log, reference)}")
        if again:  # a chain: resume the resumed run's first checkpoint
            folder, at, step = again[0]
            log = reference[:at]
            run = _Run(loaders, resume_from=folder, late=late)
            script(run, log, lambda name: None, resume_step=step)
            compared += 1
            if log != reference:
                add(f"{case}: chained resume from {folder.name} differs at entry {_first_difference(log, reference)}")
    return compared


def _first_difference(seen: list, reference: list) -> str:
    for i, (a, b) in enumerate(zip(seen, reference)):
        if a != b:
            return f"{i}: {a} instead of {b}"
    return f"{min(len(seen), len(reference))}: {len(seen)} entries instead of {len(reference)}"
