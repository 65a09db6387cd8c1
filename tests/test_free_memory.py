"""``accelerator.free_memory()`` leaves nothing of this package holding a prepared object.

A user freeing a model between two runs in one process gets its memory back the moment the program drops its
last reference: after ``model, optimizer, ... = accelerator.free_memory(model, optimizer, ...)`` every
prepared object is dead by reference counting alone (the garbage collector is off while it is dropped), after
a run that went through everything that ties state to the prepared objects: the lifecycle of a pass (one left
live, its iterator kept by the program until then), training hooks, a gradient-accumulation window, a save and
a resume, the preemption handlers.
"""

from __future__ import annotations

import gc
import signal
import weakref

import pytest
import torch
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler, TensorDataset

from accelerate_stateful import Accelerator

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


class Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(48.0).view(-1, 1))


def make_loader(kind: str, num_workers: int) -> DataLoader:
    data = TensorDataset(torch.arange(48.0).view(-1, 1))
    if kind == "batch_sampler":
        return DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), 4, False), num_workers=num_workers)
    if kind in ("stream", "dispatch"):
        return DataLoader(Stream(), batch_size=4, num_workers=num_workers)
    return DataLoader(data, batch_size=4, shuffle=True, num_workers=num_workers, persistent_workers=num_workers > 0)


def first(batch) -> torch.Tensor:
    return batch[0] if isinstance(batch, (list, tuple)) else batch


CONFIGS = [
    pytest.param(kind, workers, accumulation, keep, id=f"{kind}-workers{workers}-accumulate{accumulation}-{keep}")
    for kind, workers in [("map", 0), ("map", 2), ("batch_sampler", 0), ("stream", 0), ("dispatch", 0)]
    for accumulation in (1, 2)
    for keep in ("live-pass-kept", "pass-dropped")
]


@pytest.mark.parametrize("kind,num_workers,accumulation,keep", CONFIGS)
def test_free_memory_leaves_every_prepared_object_to_reference_counting(tmp_path, kind, num_workers, accumulation,
                                                                         keep):
    accelerator = Accelerator(
        cpu=True, gradient_accumulation_steps=accumulation,
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True, dispatch_batches=kind == "dispatch"),
        project_config=ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True),
    )
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    model, optimizer, scheduler, train, valid = accelerator.prepare(
        model, optimizer, scheduler, make_loader(kind, num_workers), make_loader("map", 0))
    accelerator.checkpoint_on_preemption()
    for step, batch in enumerate(train):
        with accelerator.accumulate(model):
            accelerator.backward(model(first(batch)).sum())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if step == 4:
            break
    accelerator.save_state()
    assert accelerator.resume() is not None
    live = iter(train)
    next(live)
    next(iter(valid))
    del batch
    if keep == "pass-dropped":
        del live
    refs = [weakref.ref(obj) for obj in (model, optimizer, scheduler, train, valid)]

    gc.collect()
    gc.disable()
    try:
        model, optimizer, scheduler, train, valid = accelerator.free_memory(model, optimizer, scheduler, train, valid)
        if keep == "live-pass-kept":
            del live
        alive = [ref() for ref in refs if ref() is not None]
    finally:
        gc.enable()
    assert alive == []
    assert (accelerator._models, accelerator._optimizers, accelerator._schedulers, accelerator._dataloaders) == (
        [], [], [], [])


def test_free_memory_gives_the_signals_back_to_their_earlier_handlers(tmp_path):
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
        project_config=ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True),
    )
    model = torch.nn.Linear(1, 1)
    model, optimizer, train = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                  make_loader("map", 0))
    accelerator.checkpoint_on_preemption()
    assert {sig: signal.getsignal(sig) for sig in before} != before
    assert optimizer.optimizer._optimizer_step_post_hooks

    accelerator.free_memory()

    assert {sig: signal.getsignal(sig) for sig in before} == before
    assert not optimizer.optimizer._optimizer_step_post_hooks
