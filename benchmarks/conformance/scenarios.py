"""The scenario matrix, the data every loader reads, and the verdict on a resumed run.

Every sample is its own id, so the ids a run trains say exactly what it saw. A "kill" ends a run right after
the save taken at that step (the best case for every loader: nothing after the save is lost to the kill);
the next run is a fresh process's objects built by the same script, which resumes as its loader's
documentation says and trains to the end. The verdict compares every id trained, in order, with the same
loader's uninterrupted run.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Optional, Sequence

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

SAMPLES, BATCH, EPOCHS, ACCUMULATION = 48, 4, 2, 2


class Ids(Dataset):
    """Map-style: sample ``i`` is the id ``i``, after ``cost_s`` of work (a decode, a remote read)."""

    def __init__(self, ids: Sequence[int], cost_s: float = 0.0) -> None:
        self.ids, self.cost_s = list(ids), cost_s

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> int:
        if self.cost_s:
            time.sleep(self.cost_s)
        return self.ids[i]


class IdStream(IterableDataset):
    """A stream as PyTorch's documentation writes one: a generator, each worker reading every n-th item."""

    def __init__(self, ids: Sequence[int], cost_s: float = 0.0) -> None:
        self.ids, self.cost_s = list(ids), cost_s

    def __iter__(self):
        info = get_worker_info()
        share = self.ids if info is None else self.ids[info.id::info.num_workers]
        for i in share:
            if self.cost_s:
                time.sleep(self.cost_s)
            yield i


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One column of the table. ``kills`` places each kill by the uninterrupted run's batches per epoch."""

    key: str
    title: str
    stream: bool = False
    workers: int = 0
    kills: tuple[str, ...] = ("mid",)
    resumed_batch: Optional[int] = None  # the batch size after the first resume (None: unchanged)
    accumulation: int = 1
    mixture: bool = False
    processes: tuple[int, int] = (1, 1)

    def batch(self, segment: int) -> int:
        return self.resumed_batch if segment > 0 and self.resumed_batch else BATCH

    def kill_steps(self, per_epoch: int) -> list[int]:
        """Global step (1-based) after which each kill happens, from the batches per epoch."""
        where = {"first": 1, "mid": max(2, int(0.4 * per_epoch)), "end": per_epoch,
                 "accum": max(3, int(0.6 * per_epoch)) | 1, "second": per_epoch + max(1, per_epoch // 2)}
        return [where[k] for k in self.kills]


SCENARIOS = (
    Scenario("map-mid", "map-style, mid-epoch"),
    Scenario("map-mid-w2", "map-style, 2 workers, mid-epoch", workers=2),
    Scenario("stream-mid", "stream, mid-epoch", stream=True),
    Scenario("stream-mid-w2", "stream, 2 workers, mid-epoch", stream=True, workers=2),
    Scenario("epoch-end", "map-style, at the epoch's end", kills=("end",)),
    Scenario("first-batch", "map-style, at the first batch", kills=("first",)),
    Scenario("mid-accum", "map-style, mid-accumulation", kills=("accum",), accumulation=ACCUMULATION),
    Scenario("chained", "map-style, chained second resume", kills=("mid", "second")),
    Scenario("stream-chained", "stream, chained second resume", stream=True, kills=("mid", "second")),
    Scenario("batch-size", "map-style, batch size 4 -> 8", resumed_batch=2 * BATCH),
    Scenario("mixture", "a mixture of two sources, mid-epoch", mixture=True),
    Scenario("1-to-2", "map-style, 1 -> 2 processes", processes=(1, 2)),
)
QUICK = ("map-mid", "stream-mid", "epoch-end")
BY_KEY = {s.key: s for s in SCENARIOS}


def source_ids(scenario: Scenario) -> list[list[int]]:
    """The sources' ids: one source, or two for a mixture (ids 0.. and 1000..)."""
    if scenario.mixture:
        return [list(range(SAMPLES // 2)), list(range(1000, 1000 + SAMPLES // 2))]
    return [list(range(SAMPLES))]


def verdict(expected: Sequence[tuple[int, int]], got: Sequence[tuple[int, int]]) -> dict:
    """``exact`` when the resumed run trained the uninterrupted run's ids in its order; else what differs."""
    want = [i for _, i in expected]
    have = [i for _, i in got]
    if want == have:
        return {"verdict": "exact"}
    lost = sum((collections.Counter(want) - collections.Counter(have)).values())
    repeated = sum((collections.Counter(have) - collections.Counter(want)).values())
    return {"verdict": "wrong", "lost": lost, "repeated": repeated, "order_differs": not (lost or repeated)}


def per_epoch_verdict(expected: Sequence[tuple[int, int]], got: Sequence[tuple[int, int]]) -> dict:
    """Across processes the order of ranks is not one sequence: each epoch's ids must come once, as a set."""
    lost = repeated = 0
    for epoch in sorted({e for e, _ in expected} | {e for e, _ in got}):
        want = collections.Counter(i for e, i in expected if e == epoch)
        have = collections.Counter(i for e, i in got if e == epoch)
        lost += sum((want - have).values())
        repeated += sum((have - want).values())
    return {"verdict": "exact"} if not (lost or repeated) else {"verdict": "wrong", "lost": lost, "repeated": repeated}


def label(result: dict) -> str:
    """A cell of the table, in words."""
    kind = result["verdict"]
    if kind == "exact":
        return "exact"
    if kind == "n/a":
        return f"n/a: {result['reason']}"
    if kind in ("refused", "crashed"):
        return f"{kind} ({result['error']})"
    if kind == "not yet measured":
        return "not yet measured"
    if result.get("order_differs"):
        return "silently wrong (same samples, another order)"
    return f"silently wrong ({result['lost']} lost, {result['repeated']} repeated)"


def seed_everything(seed: int = 0) -> None:
    import random

    import numpy

    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
