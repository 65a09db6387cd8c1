"""What each run of ``check-resume`` runs: the user's command, on the workers (and processes) of its turn.

``--workers 0,2`` cycles the runs of a chain through DataLoader worker counts: run ``k`` (from 1) of a chain
uses ``workers[(k - 1) % len(workers)]``, the uninterrupted run ``workers[0]``. The count reaches the script
through ``ACCELERATE_STATEFUL_NUM_WORKERS``, which ``Accelerator.prepare`` reads (``training/_check_workers.py``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from ..training._record_switch import WORKERS_ENV


def counts(text: str) -> list[int]:
    """``--workers 0,2``: whole numbers, 0 or more, separated by commas."""
    try:
        values = [int(s) for s in text.split(",")]
    except ValueError:
        values = [-1]
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give worker counts (0 or more) separated by commas, e.g. 0,2")
    return values


@dataclass(frozen=True)
class Variant:
    """One run's command, the environment it adds, and how the run lines describe it (empty: nothing varies)."""

    command: list
    env: dict
    label: str


@dataclass(frozen=True)
class Setup:
    """The user's command and what ``--workers`` varies between runs."""

    command: list
    workers: Optional[list] = None

    def variant(self, number: int) -> Variant:
        """Run ``number`` of a chain (from 1; the uninterrupted run is run 1 too)."""
        if not self.workers:
            return Variant(self.command, {}, "")
        count = self.workers[(number - 1) % len(self.workers)]
        return Variant(self.command, {WORKERS_ENV: str(count)}, f"{count} DataLoader worker(s)")
