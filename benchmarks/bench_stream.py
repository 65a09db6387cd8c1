"""Iterable datasets: per-batch cost, checkpoint-time cost and resume latency, with and without workers.

The companion of ``bench_loader.py`` (map-style); same conventions: one process, the contenders
interleaved round by round (A/B rotate their order every round, C shuffles every (method, position)
pair every round), the median of the rounds kept, ratios against a bare ``DataLoader``.

The dataset is :class:`CounterStream`: the ints ``0 … n-1``, split between DataLoader workers with
``get_worker_info()`` (worker ``w`` of ``W`` reads ``w, w + W, …``), resumable through
``state_dict()``/``load_state_dict()``. Its state is its position, plus optionally a *payload* that
stands for a shuffle buffer: a Python list of ints or an int64 tensor, of which one slot is overwritten
per item read, so that the state changes at every step as a real buffer's does. ``state_dict()``
returns a fresh copy of it (a snapshot, not a live reference), as a stateful dataset must.

A/B. **Per-batch cost** (``batch_size=32``), with ``num_workers=0`` and ``2``, for a state of a few
   bytes (A) and for payloads of about 100 KiB and 1 MiB (B). Each round times the first N batches of a
   pass over a stream a little longer than that, then drops the pass, so that every method is timed on
   the same steady state (the end of a stream is covered by the tests). Besides the wall time per
   batch (what a training loop that does nothing else waits for), the CPU time of the main process
   and of the workers is reported per batch: work done in a worker costs the loop nothing as long as
   the workers keep ahead of it on spare cores.
B2. **What a training loop waits for** when each step idles the CPU for 20 ms (as a loop waiting on a
   GPU does): the time spent in ``next()`` per batch, with workers.
B3. **Checkpoint-time cost**: one ``state_dict()`` call in the middle of an epoch.
C. **Resume latency**: seconds from holding a real mid-epoch state to holding the first batch after
   it, at 10 %, 50 % and 90 % of an epoch of 200,000 items, each item costing ``ITEM_COST_US`` of
   busy CPU work so that replaying samples is visible.

Usage::

    make bench                                    # both benchmarks; this one takes 2 to 3 minutes on 2 cores
    python benchmarks/bench_stream.py --quick     # about 30 s, smaller sizes
    python benchmarks/bench_stream.py --markdown stream.md
    python benchmarks/bench_stream.py --json bench_out/stream.json   # what benchmarks/plot.py draws

No figure here is asserted anywhere: ``tests/test_bench_stream_smoke.py`` only runs these functions
with tiny sizes so the script keeps working.
"""

from __future__ import annotations

import copy
import gc
import os
import pickle
import random
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import accelerate
import torch
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

import accelerate_stateful

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when a test loads this file
from _common import abandon, environment, no_gc, rotated, run_main, table  # noqa: E402,F401

FRACTIONS = (0.1, 0.5, 0.9)
ITEM_COST_US = 20.0  # busy CPU work per item in C, so that replaying items costs what reading them costs


@dataclass(frozen=True)
class StateSpec:
    """What the dataset's ``state_dict()`` carries besides its position."""

    label: str
    kind: Optional[str] = None  # None, "list" or "tensor"
    elements: int = 0  # int64 elements of the payload (8 bytes each as a tensor)


SMALL = StateSpec("position only")
LIST_100K = StateSpec("list, 100 KiB", "list", 12_800)
TENSOR_100K = StateSpec("tensor, 100 KiB", "tensor", 12_800)
LIST_1M = StateSpec("list, 1 MiB", "list", 131_072)
TENSOR_1M = StateSpec("tensor, 1 MiB", "tensor", 131_072)
LARGE_STATES = (TENSOR_100K, TENSOR_1M, LIST_100K, LIST_1M)

# Per-batch: spec label -> {num_workers: (batches timed per pass, rounds)}. Fewer batches for bigger states, so
# that a pass takes well under a second (a 1 MiB list costs tens of ms per batch to deep-copy).
FULL_SIZES = {
    "batch_size": 32,
    "per_batch": {
        SMALL.label: {0: (1_000, 7), 2: (300, 5)},
        TENSOR_100K.label: {0: (300, 3), 2: (150, 3)},
        TENSOR_1M.label: {0: (60, 3), 2: (60, 3)},
        LIST_100K.label: {0: (100, 3), 2: (100, 3)},
        LIST_1M.label: {0: (24, 3), 2: (24, 3)},
    },
    "step": {"ms": 20.0, "num_workers": 2, "states": {TENSOR_1M.label: (24, 2), LIST_1M.label: (24, 2)}},
    "checkpoint": {"batches": 16, "every": 4, "rounds": 2},
    "resume": {0: (200_000, 3), 2: (200_000, 3)},
}
QUICK_SIZES = {
    "batch_size": 32,
    "per_batch": {SMALL.label: {0: (300, 3), 2: (120, 2)}, LIST_1M.label: {0: (12, 2), 2: (16, 2)}},
    "step": {"ms": 20.0, "num_workers": 2, "states": {LIST_1M.label: (8, 1)}},
    "checkpoint": {"batches": 16, "every": 8, "rounds": 1},
    "resume": {2: (20_000, 1)},
}
# Batches in the stream beyond those timed: a pass is dropped before any worker reaches the stream's end
# (workers prefetch prefetch_factor * num_workers = 4 batches ahead here).
SPARE_BATCHES = 16
SPECS = {spec.label: spec for spec in (SMALL, *LARGE_STATES)}

BARE = "DataLoader (bare)"
TORCHDATA = "StatefulDataLoader (bare)"
ACC_DISPATCH = "accelerate stateful, dispatcher (default)"
ACC_SHARD = "accelerate stateful, dispatch_batches=False"
OURS_DISPATCH = "ours, dispatcher (default)"
OURS_SHARD = "ours, dispatch_batches=False"
ACC_PLAIN = "accelerate plain (dispatcher)"  # C only: the loader skip_first_batches works on
PER_BATCH_CONTENDERS = (BARE, TORCHDATA, ACC_DISPATCH, ACC_SHARD, OURS_DISPATCH, OURS_SHARD)
CHECKPOINT_CONTENDERS = (TORCHDATA, ACC_DISPATCH, ACC_SHARD, OURS_DISPATCH, OURS_SHARD)
STEP_CONTENDERS = (BARE, TORCHDATA, ACC_DISPATCH, OURS_DISPATCH, OURS_SHARD)

RESUME_OURS = "ours: load_state_dict (dispatcher)"
RESUME_OURS_SHARD = "ours: load_state_dict (dispatch_batches=False)"
RESUME_SKIP = "accelerate: skip_first_batches"
RESUME_TORCHDATA = "StatefulDataLoader: load_state_dict"
RESUME_ACC_STATEFUL = "accelerate stateful: load_state_dict"
RESUME_CONTENDERS = (RESUME_OURS, RESUME_SKIP, RESUME_TORCHDATA, RESUME_ACC_STATEFUL)


# --------------------------------------------------------------------------- the dataset
def _spin(microseconds: float) -> None:
    """Busy CPU work, standing for decoding or tokenising an item."""
    end = time.perf_counter() + microseconds * 1e-6
    while time.perf_counter() < end:
        pass


class CounterStream(IterableDataset):
    """``0 … n-1`` split between workers, resumable, with an optional payload in its state.

    Each pass starts at the position last loaded with ``load_state_dict()``, or at the start. The payload
    (``spec.kind``) has ``spec.elements`` ints, one slot overwritten per item read.
    """

    def __init__(self, n: int, spec: StateSpec = SMALL, item_cost_us: float = 0.0) -> None:
        self.n, self.spec, self.item_cost_us = n, spec, item_cost_us
        self.pos = 0
        self._resume_at: Optional[int] = None
        self._buffer: Any = None
        if spec.kind == "list":
            self._buffer = list(range(spec.elements))
        elif spec.kind == "tensor":
            self._buffer = torch.arange(spec.elements)
            self._slots = self._buffer.numpy()  # writing one slot through numpy costs ~0.1 µs, through torch ~1 µs

    def state_dict(self) -> dict:
        state: dict = {"pos": self.pos}
        if self.spec.kind == "list":
            state["buffer"] = list(self._buffer)
        elif self.spec.kind == "tensor":
            state["buffer"] = self._buffer.clone()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.pos = self._resume_at = state["pos"]
        if self.spec.kind == "list":
            self._buffer[:] = state["buffer"]
        elif self.spec.kind == "tensor":
            self._buffer.copy_(state["buffer"])

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = range(worker, self.n, workers)
        self.pos = self._resume_at or 0
        self._resume_at = None
        slots = self._slots if self.spec.kind == "tensor" else self._buffer
        size, cost = self.spec.elements, self.item_cost_us
        while self.pos < len(mine):
            item = mine[self.pos]
            self.pos += 1
            if slots is not None:
                slots[self.pos % size] = item
            if cost:
                _spin(cost)
            yield item


# --------------------------------------------------------------------------- contenders
def _accelerators() -> dict:
    """One Accelerator per configuration (they share Accelerate's process-wide state)."""
    stateful = DataLoaderConfiguration(use_stateful_dataloader=True)
    stateful_shard = DataLoaderConfiguration(use_stateful_dataloader=True, dispatch_batches=False)
    return {
        ACC_PLAIN: accelerate.Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration()),
        ACC_DISPATCH: accelerate.Accelerator(cpu=True, dataloader_config=stateful),
        ACC_SHARD: accelerate.Accelerator(cpu=True, dataloader_config=stateful_shard),
        OURS_DISPATCH: accelerate_stateful.Accelerator(cpu=True, dataloader_config=stateful),
        OURS_SHARD: accelerate_stateful.Accelerator(cpu=True, dataloader_config=stateful_shard),
    }


def _build(name: str, accelerators: dict, dataset: IterableDataset, batch_size: int, num_workers: int) -> Any:
    if name == BARE:
        return DataLoader(dataset, batch_size=batch_size, num_workers=num_workers)
    if name == TORCHDATA:
        return StatefulDataLoader(dataset, batch_size=batch_size, num_workers=num_workers)
    return accelerators[name].prepare(DataLoader(dataset, batch_size=batch_size, num_workers=num_workers))


def _children_cpu() -> float:
    """CPU seconds of the child processes reaped so far (a pass's workers are joined when it ends or is dropped)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# --------------------------------------------------------------------------- A/B: per-batch cost
@dataclass(frozen=True)
class PerBatchResult:
    """Medians over the rounds for one contender, one state and one worker count."""

    name: str
    state: str
    num_workers: int
    batches: int  # batches timed per pass
    us_per_batch: float  # wall in next(), steady state: after the pass's first batch
    best_us_per_batch: float  # the fastest round
    main_cpu_us: float  # CPU of the main (training) process per batch, steady state
    worker_cpu_us: float  # CPU of all workers per batch timed (start-up, prefetch and shutdown included)
    first_batch_ms: float  # from iter() to the first batch (worker start-up included)
    ratio: float  # us_per_batch / the bare DataLoader's
    step_ms: float = 0.0  # idle "training step" after each batch; us_per_batch is then the time waited in next()


def _time_pass(loader: Any, batches: int, step_s: float = 0.0) -> tuple[float, float, float, float]:
    """Take the first ``batches`` batches of a pass, then drop it.

    After each batch the loop "trains" for ``step_s`` seconds with the CPU idle (``time.sleep``, as a loop
    waiting on a GPU does); only the time spent in ``next()`` is counted as waiting for the loader.
    Returns (s to the first batch, s waited per later batch, main CPU s per later batch, worker CPU s per
    batch). The stream is longer than ``batches`` (see ``_stream_items``), so that no worker reaches its end.
    """
    with no_gc():
        children = _children_cpu()
        start = time.perf_counter()
        iterator = iter(loader)
        next(iterator)
        first = time.perf_counter()
        cpu = time.process_time()
        waited = 0.0
        for _ in range(batches - 1):
            if step_s:
                time.sleep(step_s)
            asked = time.perf_counter()
            next(iterator)
            waited += time.perf_counter() - asked
        cpu_end = time.process_time()
        del iterator  # joins the workers, so that their CPU time is counted below
        abandon(loader)
        workers = _children_cpu() - children
    later = max(batches - 1, 1)
    return first - start, waited / later, (cpu_end - cpu) / later, workers / batches


def _stream_items(batches: int, batch_size: int) -> int:
    """Items enough for ``batches`` batches and what the workers prefetch beyond them, with a margin."""
    return (batches + SPARE_BATCHES) * batch_size


def bench_per_batch(
    batches: int,
    spec: StateSpec = SMALL,
    batch_size: int = 32,
    num_workers: int = 0,
    rounds: int = 3,
    names: Sequence[str] = PER_BATCH_CONTENDERS,
    accelerators: Optional[dict] = None,
    step_ms: float = 0.0,
) -> list[PerBatchResult]:
    """Time ``batches`` batches of every contender per round, interleaved, and keep the median per contender.

    With ``step_ms``, the loop idles that long after each batch, and the time reported is what it waited for.
    """
    accelerators = accelerators or _accelerators()
    items = _stream_items(batches, batch_size)
    # One dataset per contender: with num_workers=0 its position lives in this process.
    loaders = {name: _build(name, accelerators, CounterStream(items, spec), batch_size, num_workers) for name in names}
    for loader in loaders.values():  # warm-up: imports, first allocations
        _time_pass(loader, min(batches, 8))
    samples: dict = {name: [] for name in names}
    for round_index in range(rounds):
        gc.collect()
        for name in rotated(names, round_index):
            samples[name].append(_time_pass(loaders[name], batches, step_ms / 1e3))
    results = []
    for name in names:
        firsts, steadies, cpus, workers = zip(*samples[name])
        results.append((name, statistics.median(steadies), min(steadies), statistics.median(cpus),
                        statistics.median(workers), statistics.median(firsts)))
    baseline = next((r[1] for r in results if r[0] == BARE), results[0][1])
    return [
        PerBatchResult(
            name=name, state=spec.label, num_workers=num_workers, batches=batches, us_per_batch=steady * 1e6,
            best_us_per_batch=best * 1e6, main_cpu_us=cpu * 1e6, worker_cpu_us=workers * 1e6,
            first_batch_ms=first * 1e3, ratio=steady / baseline, step_ms=step_ms,
        )
        for name, steady, best, cpu, workers, first in results
    ]


# --------------------------------------------------------------------------- B3: checkpoint-time cost
@dataclass(frozen=True)
class CheckpointResult:
    """Median seconds of one ``state_dict()`` call in the middle of an epoch."""

    name: str
    state: str
    num_workers: int
    ms: float
    best_ms: float
    state_kib: float  # the state's size, pickled


def bench_checkpoint(
    spec: StateSpec = SMALL,
    batch_size: int = 32,
    num_workers: int = 2,
    batches: int = 40,
    every: int = 8,
    rounds: int = 3,
    names: Sequence[str] = CHECKPOINT_CONTENDERS,
    accelerators: Optional[dict] = None,
) -> list[CheckpointResult]:
    """Iterate ``batches`` batches and time ``state_dict()`` after every ``every``-th one."""
    accelerators = accelerators or _accelerators()
    items = _stream_items(batches, batch_size)
    loaders = {name: _build(name, accelerators, CounterStream(items, spec), batch_size, num_workers) for name in names}
    times: dict = {name: [] for name in names}
    sizes = {}
    for round_index in range(rounds):
        gc.collect()
        for name in rotated(names, round_index):
            loader = loaders[name]
            iterator = iter(loader)
            for taken in range(1, batches + 1):
                next(iterator)
                if taken % every == 0:
                    with no_gc():
                        start = time.perf_counter()
                        state = loader.state_dict()
                        times[name].append(time.perf_counter() - start)
            sizes[name] = len(pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)) / 1024
            del iterator
            abandon(loader)
    return [
        CheckpointResult(name, spec.label, num_workers, statistics.median(times[name]) * 1e3,
                         min(times[name]) * 1e3, sizes[name])
        for name in names
    ]


# --------------------------------------------------------------------------- C: resume latency
@dataclass(frozen=True)
class ResumeResult:
    """Median seconds to the first batch after resuming at each fraction of the epoch."""

    name: str
    num_workers: int
    seconds: dict  # fraction -> median seconds
    best: dict  # fraction -> seconds in the fastest round
    exact: bool  # every resumed first batch equals the uninterrupted run's batch there
    position_s: Optional[float]  # seconds spent iterating (items free) to obtain the saved states
    note: str = ""
    rounds: int = 0  # rounds timed

    def growth(self, which: str = "seconds") -> float:
        """Time at the last fraction over time at the first (1.0 means flat)."""
        times = getattr(self, which)
        return times[max(times)] / times[min(times)]


def expected_batch(num_items: int, num_workers: int, batch_size: int, k: int) -> torch.Tensor:
    """Batch ``k`` of an uninterrupted pass: workers deliver round-robin, each from its own share."""
    workers = max(num_workers, 1)
    mine = range(k % workers, num_items, workers)
    local = k // workers
    return torch.tensor(mine[local * batch_size:(local + 1) * batch_size])


class _ResumeMethod:
    """One way of getting back to batch ``k``: ``setup`` once, then ``resume(k)`` many times."""

    name = ""
    note = ""
    loader_name = ""
    replays = False  # reads the items before k again on every resume

    def __init__(self, accelerators: dict, num_items: int, batch_size: int, num_workers: int) -> None:
        self.accelerators, self.num_items = accelerators, num_items
        self.batch_size, self.num_workers = batch_size, num_workers
        self.position_s: Optional[float] = None
        self.dataset = CounterStream(num_items, item_cost_us=ITEM_COST_US)

    def fresh(self) -> Any:
        return _build(self.loader_name, self.accelerators, self.dataset, self.batch_size, self.num_workers)

    def setup(self, positions: Sequence[int]) -> None:
        """Take a real state at every position, by iterating a loader of this kind with free items."""
        self.dataset.item_cost_us = 0.0  # read by the workers too: they get their copy at iter()
        loader = self.fresh()
        wanted, last = set(positions), max(positions)
        self.states = {}
        start = time.perf_counter()
        iterator = iter(loader)
        for taken in range(last + 1):
            if taken in wanted:
                self.states[taken] = copy.deepcopy(loader.state_dict())
            next(iterator)
        self.position_s = time.perf_counter() - start
        del iterator
        abandon(loader)
        self.dataset.item_cost_us = ITEM_COST_US

    def resume(self, position: int) -> tuple[Any, Any]:
        """Build a resumed loader and take its first batch; returns (batch, (loader, iterator))."""
        loader = self.fresh()
        loader.load_state_dict(self.states[position])
        return self.first_batch(loader)

    @staticmethod
    def first_batch(loader: Any) -> tuple[Any, Any]:
        iterator = iter(loader)  # returned too, so that tearing it down (joining workers) is not timed
        return next(iterator), (loader, iterator)


class _Ours(_ResumeMethod):
    name, loader_name = RESUME_OURS, OURS_DISPATCH
    note = "a fresh prepare, load_state_dict(state taken mid-epoch), next(iter())"


class _OursShard(_ResumeMethod):
    name, loader_name = RESUME_OURS_SHARD, OURS_SHARD
    note = _Ours.note


class _Torchdata(_ResumeMethod):
    name, loader_name = RESUME_TORCHDATA, TORCHDATA
    note = "a fresh StatefulDataLoader, load_state_dict(state taken mid-epoch), next(iter())"


class _AccelerateStateful(_ResumeMethod):
    name, loader_name = RESUME_ACC_STATEFUL, ACC_DISPATCH
    note = "a fresh prepare with use_stateful_dataloader=True, load_state_dict(state taken mid-epoch), next(iter())"


class _Skip(_ResumeMethod):
    name, loader_name = RESUME_SKIP, ACC_PLAIN
    note = "accelerator.skip_first_batches(its prepared loader, k), next(iter()): reads and drops k batches"
    replays = True

    def setup(self, positions: Sequence[int]) -> None:
        self.loader = self.fresh()  # no saved state needed: k is the position

    def resume(self, position: int) -> tuple[Any, Any]:
        return self.first_batch(self.accelerators[ACC_PLAIN].skip_first_batches(self.loader, position))


_RESUME_METHODS = {cls.name: cls for cls in (_Ours, _OursShard, _Skip, _Torchdata, _AccelerateStateful)}


def bench_resume(
    num_items: int,
    batch_size: int = 32,
    num_workers: int = 0,
    fractions: Sequence[float] = FRACTIONS,
    rounds: int = 3,
    names: Sequence[str] = RESUME_CONTENDERS,
    accelerators: Optional[dict] = None,
    replay_rounds: int = 1,
) -> list[ResumeResult]:
    """Time to the first batch after resuming at each fraction of the epoch, per method.

    A method that replays is timed in the first ``replay_rounds`` rounds only: its time is the replay's,
    seconds long and proportional to the position, so more rounds would add minutes and no information.
    """
    accelerators = accelerators or _accelerators()
    num_batches = num_items // batch_size
    positions = [min(int(f * num_batches), num_batches - 1) for f in fractions]
    methods = {name: _RESUME_METHODS[name](accelerators, num_items, batch_size, num_workers) for name in names}
    for method in methods.values():
        method.setup(positions)
    expected = {k: expected_batch(num_items, num_workers, batch_size, k) for k in positions}
    times: dict = {name: {k: [] for k in positions} for name in names}
    exact = {name: True for name in names}
    for round_index in range(rounds):
        gc.collect()
        schedule = [(name, k) for name in names for k in positions
                    if round_index < replay_rounds or not methods[name].replays]
        random.Random(round_index).shuffle(schedule)
        for name, k in schedule:
            with no_gc():
                start = time.perf_counter()
                batch, (loader, iterator) = methods[name].resume(k)
                times[name][k].append(time.perf_counter() - start)
            del iterator
            abandon(loader)
            exact[name] = exact[name] and torch.equal(torch.as_tensor(batch), expected[k])
    return [
        ResumeResult(
            name=name,
            num_workers=num_workers,
            seconds={f: statistics.median(times[name][k]) for f, k in zip(fractions, positions)},
            best={f: min(times[name][k]) for f, k in zip(fractions, positions)},
            exact=exact[name],
            position_s=methods[name].position_s,
            note=methods[name].note,
            rounds=len(times[name][positions[0]]),
        )
        for name in names
    ]


def measured_item_cost_us(items: int = 20_000) -> float:
    """What one item of C really costs to read in this process (the busy loop plus the generator)."""
    stream = CounterStream(items, item_cost_us=ITEM_COST_US)
    start = time.perf_counter()
    for _ in stream:
        pass
    return (time.perf_counter() - start) / items * 1e6


# --------------------------------------------------------------------------- report
def per_batch_table(results: Sequence[PerBatchResult]) -> list[str]:
    """The detailed table for one state and one worker count."""
    bare = next((r for r in results if r.name == BARE), results[0])
    header = ["loader", "µs / batch (median)", "vs bare", "µs / batch (best)", "vs bare (best)",
              "main CPU µs / batch", "worker CPU µs / batch", "first batch (ms)"]
    rows = [
        [r.name, f"{r.us_per_batch:.1f}", f"{r.ratio:.2f}x", f"{r.best_us_per_batch:.1f}",
         f"{r.best_us_per_batch / bare.best_us_per_batch:.2f}x", f"{r.main_cpu_us:.1f}",
         f"{r.worker_cpu_us:.1f}" if r.num_workers else "-", f"{r.first_batch_ms:.1f}"]
        for r in results
    ]
    return table(header, rows)


def _by_state(by_state: dict, cell: Callable[[Any], str]) -> list[str]:
    """One row per contender, one column per state, ``cell(result)`` in each."""
    labels = list(by_state)
    names = [r.name for r in by_state[labels[0]]]
    rows = [[name, *(cell(next(r for r in by_state[label] if r.name == name)) for label in labels)]
            for name in names]
    return table(["loader", *labels], rows)


def growth_table(by_state: dict, field: str = "us_per_batch") -> list[str]:
    """``field`` per contender and state, with the ratio to bare for wall time."""
    if field == "us_per_batch":
        return _by_state(by_state, lambda r: f"{r.us_per_batch:,.0f} ({r.ratio:.2f}x)")
    return _by_state(by_state, lambda r: f"{getattr(r, field):,.0f}")


def checkpoint_table(by_state: dict) -> list[str]:
    return _by_state(by_state, lambda r: f"{r.ms:.2f} ms / {r.state_kib:,.0f} KiB")


def resume_table(results: Sequence[ResumeResult], which: str = "seconds") -> list[str]:
    fractions = sorted(results[0].seconds)
    first, last = fractions[0], fractions[-1]
    ours = next((r for r in results if r.name == RESUME_OURS), results[0])
    header = (
        ["method"] + [f"{f:.0%} (s)" for f in fractions]
        + [f"{last:.0%} / {first:.0%}", f"vs ours at {last:.0%}", "exact", "rounds", "positioning (s)"]
    )
    rows = []
    for r in results:
        times = getattr(r, which)
        position = f"{r.position_s:.2f}" if r.position_s is not None else "-"
        rows.append([r.name, *[f"{times[f]:.4f}" for f in fractions], f"{r.growth(which):.2f}x",
                     f"{times[last] / getattr(ours, which)[last]:.1f}x", "yes" if r.exact else "NO", str(r.rounds),
                     position])
    return table(header, rows)


def render(
    env: dict, sizes: dict, per_batch: dict, with_step: dict, checkpoint: dict, resume: dict, item_cost: float
) -> str:
    """The report in markdown.

    ``per_batch`` and ``checkpoint`` map num_workers to {state label: results}, ``with_step`` maps a state
    label to results, ``resume`` maps num_workers to results.
    """
    lines = ["## Machine", ""] + [f"- {key}: {value}" for key, value in env.items()] + [""]
    lines += _per_batch_sections(sizes, per_batch)
    if with_step:
        lines += _step_section(sizes, with_step)
    lines += _checkpoint_section(sizes, checkpoint)
    lines += _resume_section(sizes, resume, item_cost)
    return "\n".join(lines) + "\n"


def _per_batch_sections(sizes: dict, per_batch: dict) -> list[str]:
    lines = ["## A. Per-batch cost, small state", ""]
    for workers, by_state in per_batch.items():
        if SMALL.label in by_state:
            batches, rounds = sizes["per_batch"][SMALL.label][workers]
            lines += [
                f"num_workers={workers}: the first {batches:,} batches of a pass (batch_size={sizes['batch_size']}), "
                f"{rounds} interleaved rounds; median and fastest round. Wall and main CPU exclude the pass's "
                "first batch; worker CPU covers the whole pass (start-up, prefetch, shutdown) per batch timed.",
                "", *per_batch_table(by_state[SMALL.label]), "",
            ]
    lines += ["## B. Per-batch cost as the dataset's state grows", ""]
    for workers, by_state in per_batch.items():
        runs = ", ".join(f"{label}: {sizes['per_batch'][label][workers][0]:,} batches × "
                         f"{sizes['per_batch'][label][workers][1]} rounds" for label in by_state)
        lines += [f"### num_workers={workers}", "", f"Sizes: {runs}.", "",
                  "Wall µs per batch, median (ratio to the bare DataLoader with the same state):", "",
                  *growth_table(by_state), "",
                  "CPU µs per batch spent in the main (training) process:", "",
                  *growth_table(by_state, "main_cpu_us"), ""]
        if workers:
            lines += ["CPU µs per batch spent in the workers (all of them, per batch delivered):", "",
                      *growth_table(by_state, "worker_cpu_us"), ""]
    return lines


def _step_section(sizes: dict, with_step: dict) -> list[str]:
    step = sizes["step"]
    runs = ", ".join(f"{label}: {batches:,} batches × {rounds} rounds"
                     for label, (batches, rounds) in step["states"].items())
    return [
        f"## B2. What a loop with a {step['ms']:.0f} ms training step waits for", "",
        f"num_workers={step['num_workers']}; after each batch the loop idles {step['ms']:.0f} ms "
        f"(time.sleep, as a loop waiting on a GPU does). Sizes: {runs}.", "",
        "µs per batch spent waiting in next(), median (ratio to the bare DataLoader):", "",
        *growth_table(with_step), "",
        "CPU µs per batch in the main process:", "", *growth_table(with_step, "main_cpu_us"), "",
        "CPU µs per batch in the workers:", "", *growth_table(with_step, "worker_cpu_us"), "",
    ]


def _checkpoint_section(sizes: dict, checkpoint: dict) -> list[str]:
    spec = sizes["checkpoint"]
    lines = ["## B3. Cost of one state_dict() call mid-epoch", "",
             f"After every {spec['every']}th of {spec['batches']} batches, {spec['rounds']} rounds; median "
             "milliseconds per call, and the size of the returned state pickled.", ""]
    for workers, by_state in checkpoint.items():
        lines += [f"num_workers={workers}:", "", *checkpoint_table(by_state), ""]
    return lines


def _resume_section(sizes: dict, resume: dict, item_cost: float) -> list[str]:
    lines = ["## C. Time to the first batch after resuming an iterable stream", ""]
    for workers, results in resume.items():
        items, rounds = sizes["resume"][workers]
        lines += [
            f"num_workers={workers}: epoch of {items:,} items, batch_size={sizes['batch_size']}, every item "
            f"costs {ITEM_COST_US:.0f} µs of busy CPU work ({item_cost:.1f} µs measured per item read in one "
            f"process); median of {rounds} round{'s' if rounds != 1 else ''}, each timing every (method, "
            "position) pair once in a shuffled order, except skip_first_batches, timed in the first round "
            "only (its replay takes seconds). 'exact': the resumed batch equals the uninterrupted stream's "
            "batch there. 'positioning': seconds spent iterating (with free items) to take that method's "
            "real mid-epoch states; not part of the resume time.",
            "", "Median of the rounds:", "", *resume_table(results), "",
            "Fastest round:", "", *resume_table(results, "best"), "",
        ]
    notes = next(iter(resume.values()), [])
    return lines + [f"- {r.name}: {r.note}" for r in notes]


def _progress(started: float, what: str) -> None:
    print(f"[{time.perf_counter() - started:5.0f} s] {what} …", flush=True)


def run_all(sizes: dict, started: float) -> tuple[dict, dict, dict, dict]:
    """Every measurement at ``sizes``: (per_batch, with_step, checkpoint, resume), as ``render`` takes them."""
    accelerators = _accelerators()
    batch_size = sizes["batch_size"]
    per_batch: dict = {}
    for label, by_workers in sizes["per_batch"].items():
        for workers, (batches, rounds) in by_workers.items():
            _progress(started, f"A/B. per-batch cost, {label}, num_workers={workers}")
            per_batch.setdefault(workers, {})[label] = bench_per_batch(
                batches, SPECS[label], batch_size, workers, rounds, accelerators=accelerators
            )
    per_batch = {workers: per_batch[workers] for workers in sorted(per_batch)}
    step, with_step = sizes["step"], {}
    for label, (batches, rounds) in step["states"].items():
        _progress(started, f"B2. a {step['ms']:.0f} ms step, {label}, num_workers={step['num_workers']}")
        with_step[label] = bench_per_batch(
            batches, SPECS[label], batch_size, step["num_workers"], rounds, STEP_CONTENDERS,
            accelerators=accelerators, step_ms=step["ms"],
        )
    checkpoint: dict = {}
    for workers, by_state in per_batch.items():
        for label in by_state:
            _progress(started, f"B3. state_dict() cost, {label}, num_workers={workers}")
            checkpoint.setdefault(workers, {})[label] = bench_checkpoint(
                SPECS[label], batch_size, workers, accelerators=accelerators, **sizes["checkpoint"]
            )
    resume = {}
    for workers, (items, rounds) in sizes["resume"].items():
        _progress(started, f"C. resume latency, num_workers={workers}")
        resume[workers] = bench_resume(items, batch_size, workers, FRACTIONS, rounds, accelerators=accelerators)
    return per_batch, with_step, checkpoint, resume


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_main(argv, __doc__, "about 30 s", (QUICK_SIZES, FULL_SIZES), measure)


def measure(sizes: dict, started: float) -> tuple[Callable[[dict], str], dict]:
    results = run_all(sizes, started)
    item_cost = measured_item_cost_us()
    data = dict(zip(("per_batch", "with_step", "checkpoint", "resume"), results), item_cost_us=item_cost)
    return (lambda env: render(env, sizes, *results, item_cost)), data


if __name__ == "__main__":
    sys.exit(main())
