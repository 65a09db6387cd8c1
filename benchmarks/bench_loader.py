"""Per-batch cost and resume latency of accelerate-stateful against the loaders it replaces.

Two measurements, in one process, with the contenders interleaved round by
round (A rotates their order every round, B shuffles every (method, position)
pair every round) and the median of the rounds kept:

A. **Per-batch cost**: full epochs over a trivial in-memory map-style dataset
   (``range(n)`` as Python ints, ``batch_size=32``, ``shuffle=True``), so the
   time measured is the loaders' own overhead: bare ``DataLoader``, bare
   torchdata ``StatefulDataLoader``, Accelerate's plain and stateful
   ``prepare``, and ours. Once with ``num_workers=0``, once with ``2``.
B. **Resume latency**: seconds from holding a saved position to holding the
   first batch after it (building the resumed loader included), at 10 %, 50 %
   and 90 % of an epoch of 1,000,000 samples. Every resumed first batch is
   compared with the batch the uninterrupted run yields at that point.

Usage::

    make bench                                   # the full run, about 2 minutes on 2 cores
    python benchmarks/bench_loader.py --quick    # about 20 s, smaller sizes
    python benchmarks/bench_loader.py --markdown docs/bench_table.md
    python benchmarks/bench_loader.py --json bench_out/loader.json   # what benchmarks/plot.py draws

No figure here is asserted anywhere: ``tests/test_bench_smoke.py`` only runs
these functions with tiny sizes so the script keeps working.
"""

from __future__ import annotations

import copy
import gc
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import accelerate
import torch
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

import accelerate_stateful

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when a test loads this file
from _common import abandon, environment, no_gc, rotated, run_main, table  # noqa: E402,F401

SEED = 1234
FRACTIONS = (0.1, 0.5, 0.9)

# (samples, rounds) per measurement; num_workers=2 runs fewer samples because on 2 cores an epoch
# with workers is ~15x slower per batch than in-process.
FULL_SIZES = {"batch_size": 32, "per_batch": {0: (100_000, 11), 2: (50_000, 9)}, "resume": (1_000_000, 9)}
QUICK_SIZES = {"batch_size": 32, "per_batch": {0: (50_000, 3), 2: (20_000, 3)}, "resume": (200_000, 3)}

BARE = "DataLoader (bare)"
TORCHDATA = "StatefulDataLoader (bare)"
ACC_PLAIN = "accelerate prepare, plain"
ACC_STATEFUL = "accelerate prepare, use_stateful_dataloader"
ACC_SEEDABLE = "accelerate prepare, use_stateful_dataloader + use_seedable_sampler"  # used in B only
OURS = "accelerate_stateful prepare (ours)"
PER_BATCH_CONTENDERS = (BARE, TORCHDATA, ACC_PLAIN, ACC_STATEFUL, OURS)

RESUME_OURS = "ours: load_state_dict"
RESUME_SKIP = "accelerate: skip_first_batches"
RESUME_TORCHDATA = "StatefulDataLoader: load_state_dict"
RESUME_ACC_STATEFUL = "accelerate stateful: load_state_dict"
RESUME_ACC_SEEDABLE = "accelerate stateful + use_seedable_sampler: load_state_dict"
RESUME_CONTENDERS = (RESUME_OURS, RESUME_SKIP, RESUME_TORCHDATA, RESUME_ACC_STATEFUL, RESUME_ACC_SEEDABLE)


class ArangeDataset(Dataset):
    """``0 … n-1`` (from ``torch.arange``) as Python ints: the cheapest sample there is."""

    def __init__(self, num_samples: int) -> None:
        self._values = torch.arange(num_samples).tolist()

    def __len__(self) -> int:
        return len(self._values)

    def __getitem__(self, index: int) -> int:
        return self._values[index]


@dataclass(frozen=True)
class PerBatchResult:
    """Medians over the rounds for one contender."""

    name: str
    num_workers: int
    batches: int
    us_per_batch: float  # steady state: after the first batch of the epoch
    best_us_per_batch: float  # the fastest round: least disturbed by other work on the machine
    first_batch_ms: float  # from iter() to the first batch (worker start-up included)
    ratio: float  # us_per_batch / the bare DataLoader's


@dataclass(frozen=True)
class ResumeResult:
    """Median seconds to the first batch after resuming at each fraction of the epoch."""

    name: str
    seconds: dict  # fraction -> median seconds
    best: dict  # fraction -> seconds in the fastest round (least disturbed by other work on the machine)
    exact: Optional[bool]  # every resumed first batch equals the uninterrupted run's batch there
    position_s: Optional[float]  # seconds spent iterating to obtain the saved states (not part of resume)
    note: str = ""

    def growth(self, which: str = "seconds") -> float:
        """Time at the last fraction over time at the first (1.0 means flat)."""
        times = getattr(self, which)
        return times[max(times)] / times[min(times)]


# --------------------------------------------------------------------------- contenders
def _accelerators() -> dict:
    """One Accelerator per configuration (they share Accelerate's process-wide state)."""
    plain = DataLoaderConfiguration(use_stateful_dataloader=False)
    stateful = DataLoaderConfiguration(use_stateful_dataloader=True)
    seedable = DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=True)
    return {
        ACC_PLAIN: accelerate.Accelerator(cpu=True, dataloader_config=plain),
        ACC_STATEFUL: accelerate.Accelerator(cpu=True, dataloader_config=stateful),
        ACC_SEEDABLE: accelerate.Accelerator(cpu=True, dataloader_config=seedable),
        OURS: accelerate_stateful.Accelerator(cpu=True, dataloader_config=stateful),
    }


def _user_loader(dataset: Dataset, batch_size: int, num_workers: int = 0, cls: type = DataLoader) -> Any:
    """The loader a user writes: shuffled, seeded through its generator."""
    generator = torch.Generator().manual_seed(SEED)
    return cls(dataset, batch_size=batch_size, shuffle=True, num_workers=num_workers, generator=generator)


def _build(name: str, accelerators: dict, dataset: Dataset, batch_size: int, num_workers: int) -> Any:
    if name == BARE:
        return _user_loader(dataset, batch_size, num_workers)
    if name == TORCHDATA:
        return _user_loader(dataset, batch_size, num_workers, cls=StatefulDataLoader)
    return accelerators[name].prepare(_user_loader(dataset, batch_size, num_workers))


# --------------------------------------------------------------------------- A: per-batch cost
def _time_epoch(loader: Iterable) -> tuple[float, float, int]:
    """(seconds to the first batch, seconds per later batch, batches) for one full epoch."""
    with no_gc():
        start = time.perf_counter()
        iterator = iter(loader)
        next(iterator)
        first = time.perf_counter()
        count = 1
        for _ in iterator:
            count += 1
        end = time.perf_counter()
    return first - start, (end - first) / max(count - 1, 1), count


def bench_per_batch(
    num_samples: int,
    batch_size: int = 32,
    num_workers: int = 0,
    rounds: int = 5,
    names: Sequence[str] = PER_BATCH_CONTENDERS,
) -> list[PerBatchResult]:
    """Time full epochs of every contender, interleaved, and keep the median per contender."""
    dataset = ArangeDataset(num_samples)
    accelerators = _accelerators()
    loaders = {name: _build(name, accelerators, dataset, batch_size, num_workers) for name in names}
    for loader in loaders.values():  # warm-up: imports, first allocations
        _time_epoch(loader)
    firsts: dict = {name: [] for name in names}
    steadies: dict = {name: [] for name in names}
    counts = {}
    for round_index in range(rounds):
        gc.collect()
        for name in rotated(names, round_index):
            first, steady, counts[name] = _time_epoch(loaders[name])
            firsts[name].append(first)
            steadies[name].append(steady)
    medians = {name: statistics.median(steadies[name]) for name in names}
    baseline = medians.get(BARE, medians[names[0]])
    return [
        PerBatchResult(
            name=name,
            num_workers=num_workers,
            batches=counts[name],
            us_per_batch=medians[name] * 1e6,
            best_us_per_batch=min(steadies[name]) * 1e6,
            first_batch_ms=statistics.median(firsts[name]) * 1e3,
            ratio=medians[name] / baseline,
        )
        for name in names
    ]


# --------------------------------------------------------------------------- B: resume latency
def _equal(a: Any, b: Any) -> bool:
    return torch.equal(torch.as_tensor(a), torch.as_tensor(b))


def _iterate_to(loader: Any, positions: Sequence[int], snapshot: Callable[[], Any]) -> tuple[dict, dict, float]:
    """Iterate ``loader`` once; at each position take ``snapshot()`` and the batch that follows.

    Returns (position -> snapshot, position -> next batch, seconds spent).
    """
    wanted = set(positions)
    last = max(positions)
    snapshots, expected = {}, {}
    start = time.perf_counter()
    iterator = iter(loader)
    taken = 0
    while taken <= last:
        if taken in wanted:
            snapshots[taken] = copy.deepcopy(snapshot())
        batch = next(iterator)
        if taken in wanted:
            expected[taken] = batch
        taken += 1
    seconds = time.perf_counter() - start
    del iterator
    abandon(loader)
    return snapshots, expected, seconds


class _ResumeMethod:
    """One way of getting back to batch ``k``: ``setup`` once, then ``resume(k)`` many times."""

    name = ""
    note = ""

    def __init__(self, accelerators: dict, dataset: Dataset, batch_size: int) -> None:
        self.accelerators, self.dataset, self.batch_size = accelerators, dataset, batch_size
        self.position_s: Optional[float] = None

    def fresh(self) -> Any:
        raise NotImplementedError

    def setup(self, positions: Sequence[int]) -> dict:
        """Prepare every position; return position -> the uninterrupted run's batch there."""
        raise NotImplementedError

    def resume(self, position: int) -> tuple[Any, Any]:
        """Build a resumed loader and take its first batch; returns (batch, (loader, iterator))."""
        raise NotImplementedError

    @staticmethod
    def first_batch(loader: Any) -> tuple[Any, Any]:
        # The iterator is returned too, so that tearing it down is not timed.
        iterator = iter(loader)
        return next(iterator), (loader, iterator)


class _Ours(_ResumeMethod):
    name = RESUME_OURS
    note = "state taken with seek(k) (no reading)"

    def fresh(self) -> Any:
        return self.accelerators[OURS].prepare(_user_loader(self.dataset, self.batch_size))

    def setup(self, positions: Sequence[int]) -> dict:
        source = self.fresh()
        self.states = {}
        for k in positions:
            source.seek(k)
            self.states[k] = source.state_dict()
        # The reference: an uninterrupted loader iterated up to each position.
        reference = self.fresh()
        _, expected, _ = _iterate_to(reference, positions, lambda: None)
        return expected

    def resume(self, position: int) -> tuple[Any, Any]:
        loader = self.fresh()
        loader.load_state_dict(self.states[position])
        return self.first_batch(loader)


class _Skip(_ResumeMethod):
    name = RESUME_SKIP
    note = "replays the sampler up to k; its generator is reset to the epoch-start state before each resume"

    def setup(self, positions: Sequence[int]) -> dict:
        self.loader = self.accelerators[ACC_PLAIN].prepare(_user_loader(self.dataset, self.batch_size))
        # The epoch's order comes from the sampler's generator; every resume starts from the same state.
        self.generator = self.loader.batch_sampler.sampler.generator
        self.generator_state = self.generator.get_state()
        _, expected, _ = _iterate_to(self.loader, positions, lambda: None)
        return expected

    def resume(self, position: int) -> tuple[Any, Any]:
        self.generator.set_state(self.generator_state)
        return self.first_batch(self.accelerators[ACC_PLAIN].skip_first_batches(self.loader, position))


class _Torchdata(_ResumeMethod):
    name = RESUME_TORCHDATA
    note = "state from iterating to k; load replays the sampler"

    def fresh(self) -> Any:
        return _user_loader(self.dataset, self.batch_size, cls=StatefulDataLoader)

    def setup(self, positions: Sequence[int]) -> dict:
        source = self.fresh()
        self.states, expected, self.position_s = _iterate_to(source, positions, source.state_dict)
        return expected

    def resume(self, position: int) -> tuple[Any, Any]:
        loader = self.fresh()
        loader.load_state_dict(self.states[position])
        return self.first_batch(loader)


class _AccelerateStateful(_Torchdata):
    name = RESUME_ACC_STATEFUL
    note = (
        "state from iterating to k; load replays the sampler; with a plain RandomSampler the resumed "
        "iterator draws a new permutation, so the batch is not the uninterrupted run's"
    )
    accelerator = ACC_STATEFUL

    def fresh(self) -> Any:
        return self.accelerators[self.accelerator].prepare(_user_loader(self.dataset, self.batch_size))


class _AccelerateSeedable(_AccelerateStateful):
    name = RESUME_ACC_SEEDABLE
    note = "state from iterating to k; load replays the sampler (SeedableRandomSampler: same order on resume)"
    accelerator = ACC_SEEDABLE


_RESUME_METHODS = {
    cls.name: cls for cls in (_Ours, _Skip, _Torchdata, _AccelerateStateful, _AccelerateSeedable)
}


def bench_resume(
    num_samples: int,
    batch_size: int = 32,
    fractions: Sequence[float] = FRACTIONS,
    rounds: int = 5,
    names: Sequence[str] = RESUME_CONTENDERS,
) -> list[ResumeResult]:
    """Time to the first batch after resuming at each fraction of the epoch, per method."""
    dataset = ArangeDataset(num_samples)
    num_batches = -(-num_samples // batch_size)
    positions = [min(int(f * num_batches), num_batches - 1) for f in fractions]
    accelerators = _accelerators()
    methods = {name: _RESUME_METHODS[name](accelerators, dataset, batch_size) for name in names}
    expected = {name: method.setup(positions) for name, method in methods.items()}
    times: dict = {name: {k: [] for k in positions} for name in names}
    exact = {name: True for name in names}
    for round_index in range(rounds):
        gc.collect()
        # Every (method, position) once per round, in an order shuffled per round so that no
        # method or position always runs first (or right after the most expensive one).
        schedule = [(name, k) for name in names for k in positions]
        random.Random(round_index).shuffle(schedule)
        for name, k in schedule:
            with no_gc():
                start = time.perf_counter()
                batch, (loader, iterator) = methods[name].resume(k)
                times[name][k].append(time.perf_counter() - start)
            del iterator
            abandon(loader)
            exact[name] = exact[name] and _equal(batch, expected[name][k])
    return [
        ResumeResult(
            name=name,
            seconds={f: statistics.median(times[name][k]) for f, k in zip(fractions, positions)},
            best={f: min(times[name][k]) for f, k in zip(fractions, positions)},
            exact=exact[name],
            position_s=methods[name].position_s,
            note=methods[name].note,
        )
        for name in names
    ]


# --------------------------------------------------------------------------- report
def per_batch_table(results: Sequence[PerBatchResult]) -> list[str]:
    bare = next((r for r in results if r.name == BARE), results[0])
    rows = [
        [
            r.name,
            f"{r.us_per_batch:.1f}",
            f"{r.ratio:.2f}x",
            f"{r.best_us_per_batch:.1f}",
            f"{r.best_us_per_batch / bare.best_us_per_batch:.2f}x",
            f"{r.first_batch_ms:.1f}",
            str(r.batches),
        ]
        for r in results
    ]
    header = ["loader", "µs / batch (median)", "vs bare", "µs / batch (best)", "vs bare (best)",
              "first batch (ms)", "batches / epoch"]
    return table(header, rows)


def resume_table(results: Sequence[ResumeResult], which: str = "seconds") -> list[str]:
    """``which`` is ``"seconds"`` (medians) or ``"best"`` (fastest rounds)."""
    fractions = sorted(results[0].seconds)
    first, last = fractions[0], fractions[-1]
    ours = next((r for r in results if r.name == RESUME_OURS), None)
    header = (
        ["method"]
        + [f"{f:.0%} (s)" for f in fractions]
        + [f"{last:.0%} / {first:.0%}", f"vs ours at {last:.0%}", "exact", "positioning (s)"]
    )
    rows = []
    for r in results:
        times = getattr(r, which)
        vs_ours = f"{times[last] / getattr(ours, which)[last]:.1f}x" if ours is not None else "-"
        position = f"{r.position_s:.2f}" if r.position_s is not None else "-"
        exact = {True: "yes", False: "NO", None: "-"}[r.exact]
        cells = [f"{times[f]:.4f}" for f in fractions]
        rows.append([r.name, *cells, f"{r.growth(which):.2f}x", vs_ours, exact, position])
    return table(header, rows)


def render(env: dict, sizes: dict, per_batch: dict, resume: Sequence[ResumeResult]) -> str:
    lines = ["## Machine", ""]
    lines += [f"- {key}: {value}" for key, value in env.items()]
    lines += ["", "## A. Per-batch cost", ""]
    for workers, results in per_batch.items():
        samples, rounds = sizes["per_batch"][workers]
        lines += [
            f"num_workers={workers}: {samples:,} samples, batch_size={sizes['batch_size']}, "
            f"shuffle=True, {rounds} interleaved epochs per loader; median and fastest epoch "
            "(µs / batch excludes the epoch's first batch, shown apart).",
            "",
            *per_batch_table(results),
            "",
        ]
    samples, rounds = sizes["resume"]
    lines += [
        "## B. Time to the first batch after resuming",
        "",
        f"Epoch of {samples:,} samples, batch_size={sizes['batch_size']}, shuffle=True; median of "
        f"{rounds} rounds, each timing every (method, position) pair once in a shuffled order. Seconds from "
        "a saved position to the first batch, building the resumed loader included. 'exact': the resumed "
        "batch equals the uninterrupted run's batch there. 'positioning': seconds the benchmark spent "
        "iterating to the positions to obtain that method's saved states (training time in real life, not "
        "part of the resume time).",
        "",
        "Median of the rounds:",
        "",
        *resume_table(resume),
        "",
        "Fastest round (the least disturbed by other work on the machine):",
        "",
        *resume_table(resume, "best"),
        "",
    ]
    lines += [f"- {r.name}: {r.note}" for r in resume if r.note]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_main(argv, __doc__, "about 20 s", (QUICK_SIZES, FULL_SIZES), measure)


def measure(sizes: dict, started: float) -> tuple[Callable[[dict], str], dict]:
    per_batch = {}
    for workers, (samples, rounds) in sizes["per_batch"].items():
        print(f"A. per-batch cost, num_workers={workers} …", flush=True)
        per_batch[workers] = bench_per_batch(samples, sizes["batch_size"], workers, rounds)
    print("B. resume latency …", flush=True)
    samples, rounds = sizes["resume"]
    resume = bench_resume(samples, sizes["batch_size"], FRACTIONS, rounds)
    return (lambda env: render(env, sizes, per_batch, resume)), {"per_batch": per_batch, "resume": resume}


if __name__ == "__main__":
    sys.exit(main())
