"""``check-resume --at``: kill points, as step numbers or names resolved from the uninterrupted run's records.

A step ``S`` kills once the records reach step ``S``. A name is a moment of the uninterrupted run, found in its
records (``training/_record.py``) and killed at when a run's records show that moment again:

- ``first-batch``: after the first step of the second epoch (the first batch of an epoch that a resume starts);
- ``epoch-end``: after the last step of the first epoch;
- ``mid-accumulation``: after the first ``accelerator.backward`` of the first step that accumulates several;
- ``eval``: when an evaluation loader hands out its first batch (a batch handed out while a prepared model is in
  ``eval()`` mode);
- ``save``: inside the first ``save_state``: Accelerate's files (model, optimizer, RNG) are written, the loaders'
  positions and the seal are not, so the checkpoint is incomplete and a resume must not take it.

Each process of the run stops itself when its records reach the point (``_record_switch.HOLD_ENV``), and the
checker signals the run once they have: the kill lands at the point, however fast or slow the run is.

A name the uninterrupted run never reaches (one epoch only, no evaluation, ...) is reported, never dropped silently.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional, Union

from ..training._record_switch import reaches

NAMES = ("first-batch", "epoch-end", "mid-accumulation", "eval", "save")


def points(text: str) -> list[Union[int, str]]:
    """``--at 3,epoch-end,save``: step numbers (from 1) and names, separated by commas."""
    found: list[Union[int, str]] = []
    for word in text.split(","):
        if word in NAMES:
            found.append(word)
            continue
        try:
            step = int(word)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{word!r}: give steps (e.g. 3,7) or names of moments ({', '.join(NAMES)}), separated by commas"
            ) from None
        if step < 1:
            raise argparse.ArgumentTypeError(f"{word!r}: steps count from 1 (a kill comes after a step)")
        found.append(step)
    return found


@dataclass(frozen=True)
class Point:
    """Kill once a run's records show ``event`` (``step``: a step record) at ``step``; ``order`` sorts points
    in the run's time (an event after step ``S`` sorts between ``S`` and ``S + 1``)."""

    name: str
    event: str
    step: int

    @property
    def order(self) -> float:
        return self.step if self.event == "step" else self.step + 0.5

    def reached(self, record: dict) -> bool:
        return reaches(self.hold(), record)

    def hold(self) -> dict:
        """The point as the training processes read it (``_record_switch.HOLD_ENV``)."""
        return {"event": self.event, "step": self.step}

    def describe(self) -> str:
        where = {"step": f"step {self.step}", "backward": f"the first backward of step {self.step + 1}",
                 "eval": f"the first evaluation batch after step {self.step}",
                 "saving": f"inside the save after step {self.step}, its model files written"}[self.event]
        return where if self.name.isdigit() else f"{self.name} ({where})"


def resolve(wanted: list, reference: dict[int, list[dict]]) -> tuple[list[Point], list[str]]:
    """The kill points of ``wanted`` in the uninterrupted run's records (rank 0's), sorted; and the names the
    uninterrupted run never reached."""
    lines = reference.get(0, [])
    found, missing = [], []
    for want in wanted:
        point = Point(str(want), "step", want) if isinstance(want, int) else _named(want, lines)
        if point is None:
            missing.append(want)
        else:
            found.append(point)
    return sorted(set(found), key=lambda p: (p.order, p.name)), missing


def _named(name: str, lines: list[dict]) -> Optional[Point]:
    steps = [r for r in lines if r.get("event") == "step"]
    epochs = [(r["step"], r.get("epoch")) for r in steps]
    if name in ("first-batch", "epoch-end"):
        for (step, epoch), (after, next_epoch) in zip(epochs, epochs[1:]):
            if epoch is not None and next_epoch is not None and next_epoch > epoch:
                return Point(name, "step", after if name == "first-batch" else step)
        return None
    if name == "mid-accumulation":
        step = next((r["step"] for r in steps if len(r["losses"]) > 1), None)
        return Point(name, "backward", step - 1) if step is not None else None
    event = {"eval": "eval", "save": "saving"}[name]
    step = next((r["step"] for r in lines if r.get("event") == event), None)
    return Point(name, event, step) if step is not None else None
