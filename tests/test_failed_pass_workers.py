"""A pass ended by an exception from the data stops its worker processes at once, on the main thread.

The exception is kept (``except ValueError as exc: kept = exc``), which keeps its traceback, the frames in
it and the base iterator they hold: the workers must be gone when the ``except`` block is entered, not when
the garbage collector frees that iterator. Every loader variant, one and two workers, persistent or not.
A loader with persistent workers starts new ones at its next pass, which reads its epoch whole.

Children are read from ``/proc`` (the workers are this process's children, fork context); zombies count
as gone.
"""

from __future__ import annotations

import gc
import itertools
import os
from pathlib import Path

import pytest
import torch
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, SequentialSampler

from accelerate_stateful import Accelerator

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")
N, BAD = 40, 21
VARIANTS = ["shard", "batchsampler", "stream", "dispatch", "dispatch-stream"]


def live_children() -> set[int]:
    """This process's children that have not exited (from ``/proc``: no psutil needed)."""
    me, found = os.getpid(), set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited while listed
            continue
        state, parent = stat[stat.rindex(")") + 2:].split()[:2]
        if int(parent) == me and state not in ("Z", "X"):
            found.add(int(entry.name))
    return found


class Once:
    """Record ``BAD`` is corrupt the first time it is read (a marker file: workers are other processes)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def read(self, index: int) -> int:
        if index == BAD and not self.marker.exists():
            self.marker.touch()
            raise ValueError(f"record {BAD} is corrupt")
        return index


class Records(Dataset):
    def __init__(self, once: Once) -> None:
        self.once = once

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> int:
        return self.once.read(index)


class RecordStream(IterableDataset):
    def __init__(self, once: Once) -> None:
        self.once = once

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for index in range(worker, N, workers):
            yield self.once.read(index)


def prepared(variant: str, workers: int, persistent: bool, marker: Path):
    dispatch = variant.startswith("dispatch")
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_stateful_dataloader=True, dispatch_batches=dispatch))
    options = {"num_workers": workers, "persistent_workers": persistent}
    once = Once(marker)
    if variant == "batchsampler":
        dl = DataLoader(Records(once), batch_sampler=BatchSampler(SequentialSampler(range(N)), 2, False), **options)
    elif variant.endswith("stream"):
        dl = DataLoader(RecordStream(once), batch_size=2, **options)
    else:
        dl = DataLoader(Records(once), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0),
                        **options)
    return accelerator, accelerator.prepare(dl)


@pytest.mark.parametrize(
    "variant, workers, persistent",
    [pytest.param(v, w, p, id=f"{v}-{w}w-{'persistent' if p else 'per-pass'}")
     for v, w, p in itertools.product(VARIANTS, [1, 2], [False, True])],
)
def test_a_pass_ended_by_a_corrupt_record_leaves_no_worker_running_while_the_exception_is_kept(
        tmp_path, variant, workers, persistent):
    accelerator, dl = prepared(variant, workers, persistent, tmp_path / "failed-once")
    before = live_children()
    for _ in dl:  # a warm-up peek first: persistent workers then serve the failing pass too
        break
    kept = None
    try:
        for _ in dl:
            accelerator.backward(torch.zeros((), requires_grad=True))
    except ValueError as exc:
        kept = exc
        left = live_children() - before
    assert kept is not None and f"record {BAD}" in str(kept) and kept.__traceback__ is not None
    assert left == set(), f"{len(left)} worker processes still running after the pass failed"

    seen = [i for batch in dl for i in batch.tolist()]  # the next pass: new workers, the next epoch whole
    assert sorted(seen) == list(range(N))
    assert len(live_children() - before) == (workers if persistent else 0)


def test_a_pass_ended_by_an_exception_in_every_epoch_never_accumulates_workers(tmp_path):
    """A loop that catches a corrupt-record error each epoch and goes on: at most one pass's workers live."""
    class AlwaysCorrupt(Dataset):
        def __len__(self) -> int:
            return N

        def __getitem__(self, index: int) -> int:
            if index == BAD:
                raise ValueError(f"record {BAD} is corrupt")
            return index

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    dl = accelerator.prepare(DataLoader(AlwaysCorrupt(), batch_size=2, num_workers=2, persistent_workers=True))
    before, kept = live_children(), []
    for _ in range(3):
        try:
            for _ in dl:
                pass
        except ValueError as exc:
            kept.append(exc)
        assert live_children() - before == set()
    assert len(kept) == 3


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("persistent", [False, True], ids=["live-pass", "persistent"])
def test_workers_freed_by_the_garbage_collector_are_stopped_before_torchs_clean_up(
        tmp_path, monkeypatch, variant, persistent):
    """A loader held in a reference cycle is freed by the cyclic collector, which may finalize the queues its
    base iterator sends work through before torch's clean-up runs: that clean-up's end message would reach no
    worker, and it would wait its join timeout for each. The package's finalizer stops them first, through the
    queues it keeps open (``loaders/_workers``): torch's clean-up finds every worker ended."""
    from multiprocessing.connection import wait

    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    found = []
    original = _MultiProcessingDataLoaderIter._shutdown_workers

    def recording(self):
        if not self._shutdown and {worker.pid for worker in self._workers} & ours:
            # A worker has ended once its sentinel is ready (is_alive() may lag behind, until it can be reaped).
            ended = set(wait([worker.sentinel for worker in self._workers], timeout=0))
            found.append([worker.sentinel not in ended for worker in self._workers])
        original(self)

    gc.collect()  # what earlier tests left to the collector goes first
    monkeypatch.setattr(_MultiProcessingDataLoaderIter, "_shutdown_workers", recording)
    (tmp_path / "failed-once").touch()  # no record fails here
    accelerator, dl = prepared(variant, 2, persistent, tmp_path / "failed-once")
    before, ours = live_children(), set()
    if persistent:
        assert len([batch for batch in dl]) > 0  # the workers stay for the next pass
        held = None
    else:
        held = iter(dl)
        next(held)  # a live pass, its workers running
    ours |= live_children() - before
    cycle = {"loader": dl, "accelerator": accelerator, "pass": held}
    cycle["self"] = cycle
    del accelerator, dl, held, cycle
    gc.collect()
    assert found and all(not any(alive) for alive in found), f"torch's clean-up found workers running: {found}"
    assert live_children() - before == set()
