"""The PyTorch-side loaders, each written as its own documentation says to resume it.

- ours: ``accelerate_stateful.Accelerator``, ``use_stateful_dataloader=True``, ``accelerator.resume()``, the
  loop's first epoch from ``train_dl.epoch`` (README quick start);
- Accelerate with ``use_stateful_dataloader=True``: ``save_state``/``load_state``, the epoch kept by the script
  (Accelerate's "Checkpointing" guide);
- Accelerate with ``skip_first_batches``: ``load_state``, then the first epoch's batches up to the step are
  skipped (Accelerate's ``examples/complete_nlp_example.py``: the step in the checkpoint's name);
- torchdata's ``StatefulDataLoader`` on its own: ``state_dict()``/``load_state_dict()`` saved with the epoch.

A segment is one process's life: everything is built afresh (Accelerate's singletons reset), the script
resumes if a checkpoint is there, trains ``stop`` batches (``None``: to the end) and saves there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch
from torch.utils.data import ConcatDataset, DataLoader, DistributedSampler, WeightedRandomSampler

from scenarios import EPOCHS, Ids, IdStream, Scenario, seed_everything, source_ids

Trained = list  # [(epoch, id), ...]


def world() -> tuple[int, int]:
    """This process's rank and the number of processes, as the launcher set them (1 process: ``(0, 1)``)."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def dataset(scenario: Scenario, cost_s: float = 0.0, ours: bool = False):
    """The data and the sampler a user of a PyTorch loader writes for the scenario."""
    sources = source_ids(scenario)
    if scenario.mixture and ours:
        from accelerate_stateful import Mixture

        return Mixture({"a": sources[0], "b": sources[1]}, {"a": 0.5, "b": 0.5}, seed=0), None
    if scenario.mixture:  # PyTorch's own way to mix: weighted draws over the concatenation
        data = ConcatDataset([Ids(s, cost_s) for s in sources])
        sampler = WeightedRandomSampler([1.0] * len(data), len(data), generator=torch.Generator().manual_seed(0))
        return data, sampler
    return (IdStream(sources[0], cost_s) if scenario.stream else Ids(sources[0], cost_s)), None


def loader(cls, scenario: Scenario, segment: int, cost_s: float = 0.0, ours: bool = False):
    data, sampler = dataset(scenario, cost_s, ours)
    shuffle = not scenario.stream and sampler is None and not (scenario.mixture and ours)
    return cls(data, batch_size=scenario.batch(segment), shuffle=shuffle, sampler=sampler,
               num_workers=scenario.workers)


def _model():
    model = torch.nn.Linear(1, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _step(model, batch) -> None:
    model(batch.float().unsqueeze(1)).sum().backward()


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _meta(folder: Path) -> Optional[dict]:
    path = folder / "meta.json"
    return json.loads(path.read_text()) if path.exists() else None


def accelerate_segment(kind: str, scenario: Scenario, folder: Path, segment: int, stop: Optional[int],
                       on_first=None, cost_s: float = 0.0) -> Trained:
    """One process of an Accelerate script: ``kind`` is ``ours``, ``stateful`` or ``skip``."""
    import accelerate
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration

    import accelerate_stateful

    _reset_accelerate()
    seed_everything()
    cls = accelerate_stateful.Accelerator if kind == "ours" else accelerate.Accelerator
    accelerator = cls(
        cpu=True, gradient_accumulation_steps=scenario.accumulation,
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=kind != "skip"),
        project_config=ProjectConfiguration(project_dir=str(folder), automatic_checkpoint_naming=kind == "ours"))
    model, optimizer = _model()
    model, optimizer, train_dl = accelerator.prepare(
        model, optimizer, loader(DataLoader, scenario, segment, cost_s, ours=kind == "ours"))
    meta, start_epoch, skip = _meta(folder), 0, 0
    if kind == "ours":
        accelerator.resume()
        start_epoch = train_dl.epoch
    elif meta is not None:
        accelerator.load_state(str(folder / f"step_{meta['step']}"))  # complete_nlp_example.py's folders
        start_epoch = meta["epoch"]
        if kind == "skip":  # complete_nlp_example.py: the overall step, then the epoch and the step in it
            start_epoch, skip = divmod(meta["step"], len(train_dl)) if not scenario.stream else (meta["epoch"], meta["in_epoch"])
    trained, done, step = [], 0, (meta or {}).get("step", 0)
    for epoch in range(start_epoch, EPOCHS):
        active = accelerator.skip_first_batches(train_dl, skip) if kind == "skip" and skip and epoch == start_epoch else train_dl
        in_epoch = skip if epoch == start_epoch else 0
        for batch in active:
            if on_first is not None:
                return on_first()
            with accelerator.accumulate(model):
                _step(model, batch)
                optimizer.step()
                optimizer.zero_grad()
            trained += [(epoch, int(i)) for i in batch]
            done, step, in_epoch = done + 1, step + 1, in_epoch + 1
            if done == stop:
                accelerator.save_state(None if kind == "ours" else str(folder / f"step_{step}"))
                if accelerator.is_main_process:
                    (folder / "meta.json").write_text(json.dumps({"epoch": epoch, "step": step, "in_epoch": in_epoch}))
                accelerator.wait_for_everyone()
                _end(accelerator, train_dl)
                return trained
    _end(accelerator, train_dl)
    return trained


def _end(accelerator, train_dl) -> None:
    end = getattr(accelerator, "end_training", None)
    if callable(end):
        end()


def torchdata_segment(scenario: Scenario, folder: Path, segment: int, stop: Optional[int],
                      on_first=None, cost_s: float = 0.0) -> Trained:
    """torchdata's README: ``state_dict()`` saved with the checkpoint, ``load_state_dict()`` before iterating."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    seed_everything()
    if scenario.processes != (1, 1):  # torchdata's way to split the data between processes: a DistributedSampler
        data, _ = dataset(scenario, cost_s)
        sampler = DistributedSampler(data, num_replicas=world()[1], rank=world()[0], shuffle=True, seed=0)
        dl = StatefulDataLoader(data, batch_size=scenario.batch(segment), sampler=sampler,
                                num_workers=scenario.workers)
    else:
        sampler, dl = None, loader(StatefulDataLoader, scenario, segment, cost_s)
    path, start_epoch = folder / "loader.pt", 0
    if path.exists():
        saved = torch.load(path, weights_only=False)
        dl.load_state_dict(saved["loader"])
        start_epoch = saved["epoch"]
    model, optimizer = _model()
    trained, done = [], 0
    for epoch in range(start_epoch, EPOCHS):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for batch in dl:
            if on_first is not None:
                return on_first()
            _step(model, batch)
            optimizer.step()
            optimizer.zero_grad()
            trained += [(epoch, int(i)) for i in batch]
            done += 1
            if done == stop:
                torch.save({"loader": dl.state_dict(), "epoch": epoch}, path)
                return trained
    return trained
