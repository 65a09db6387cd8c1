"""One cell of the table: a loader, a scenario, its uninterrupted run, the killed and resumed one, the verdict.

A run that raises is *refused* when the loader said no on purpose (a ``ValueError``/``RuntimeError`` family
error or this package's own errors) and *crashed* otherwise (an ``IndexError``, a ``KeyError``, a worker's
death...). The time to the first batch is taken from the resumed process's start (its objects built, the
checkpoint loaded) to the first batch in hand.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
import warnings
from pathlib import Path

from scenarios import BATCH, BY_KEY, SAMPLES, Scenario, verdict

DELIBERATE = (ValueError, RuntimeError, NotImplementedError)
ACCIDENTAL = (IndexError, KeyError, TypeError, AttributeError)
POSITIONS = (0.1, 0.5, 0.9)
COST_S = 0.005  # each sample's cost in the timed resume


def quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("accelerate", "accelerate_stateful", "datasets", "transformers", "torchdata"):
        logging.getLogger(name).setLevel(logging.ERROR)


def failure(exc: BaseException) -> dict:
    kind = "refused" if isinstance(exc, DELIBERATE) and not isinstance(exc, ACCIDENTAL) else "crashed"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return {"verdict": kind, "error": f"{type(exc).__name__}: {first[:100]}"}


def measure(peer, scenario: Scenario) -> dict:
    """The cell's result: ``{"verdict": ..., ...}``."""
    reason = peer.not_applicable(scenario)
    if reason:
        return {"verdict": "n/a", "reason": reason}
    with tempfile.TemporaryDirectory() as folder:
        try:
            expected = peer.segment(scenario, Path(folder), 0, None)
        except Exception as exc:  # the uninterrupted run itself fails: nothing to compare with
            return {**failure(exc), "note": "the uninterrupted run failed"}
    per_epoch = -(-sum(1 for e, _ in expected if e == 0) // BATCH) or 1
    kills = scenario.kill_steps(per_epoch)
    trained, done = [], 0
    with tempfile.TemporaryDirectory() as folder:
        try:
            for segment, kill in enumerate([*kills, None]):
                part = peer.segment(scenario, Path(folder), segment, None if kill is None else kill - done)
                trained += part
                done = kill or done
        except Exception as exc:
            return {**failure(exc), "kills": kills}
    return {**verdict(expected, trained), "kills": kills}


def time_to_first_batch(peer, rounds: int) -> dict:
    """``{"map"/"stream": {position: seconds}}``: from the resumed process's start to its first batch, at
    10/50/90 % of an epoch, 0 workers, each sample costing ``COST_S`` (a string: the error it raised)."""
    found = {}
    for kind in ("map", "stream"):
        scenario = BY_KEY[f"{kind}-mid"]
        if peer.not_applicable(scenario):
            continue
        found[kind] = {str(position): _timed(peer, scenario, position, rounds) for position in POSITIONS}
    return found


def _timed(peer, scenario: Scenario, position: float, rounds: int):
    kill, times = max(1, round(position * SAMPLES / BATCH)), []
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as folder:
            try:
                peer.segment(scenario, Path(folder), 0, kill, cost_s=COST_S)
                started = time.perf_counter()
                times.append(peer.segment(scenario, Path(folder), 1, None, cost_s=COST_S,
                                          on_first=lambda: time.perf_counter() - started))
            except Exception as exc:
                return failure(exc)["error"]
    return statistics.median(times)
