"""The record files of ``accelerate-stateful check-resume``: their switch, their lines, the active recorder.

``training/_record.py`` writes them in the training processes; ``cli/_stitch.py`` reads them in the checker,
which must not import torch; a loader's ``next()`` hands its batch to the active recorder, and the loaders'
modules are read by the command line too, so none of this imports torch.
"""

from __future__ import annotations

import json
from typing import Any, Optional

RECORD_ENV = "ACCELERATE_STATEFUL_RECORD"  # the folder the checker records a run into; unset: no recording
WORKERS_ENV = "ACCELERATE_STATEFUL_NUM_WORKERS"  # check-resume --workers: each prepared DataLoader's num_workers
# check-resume's kill point (JSON: ``{"event": ..., "step": ...}``): a process that records it writes a ``held``
# line and stops itself (SIGSTOP), so the checker's signal lands exactly there, however fast the run goes.
HOLD_ENV = "ACCELERATE_STATEFUL_RECORD_HOLD"

# This process's ``training._record.Recorder``, or None: the hook points (a batch handed out, a backward, a
# save, a load) test this alone, so with recording off they cost one comparison. Set when an Accelerator is made.
active: Optional[Any] = None


def parse_line(line: str) -> Optional[dict]:
    """One record, or ``None`` for the remains of a line that a kill cut short."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def reaches(point: dict, record: dict) -> bool:
    """Whether ``record`` is the moment ``point`` names (``cli/_kill_points.Point``): the record of step ``step``
    (or a later one), the first ``backward`` of the step after ``step``, or an ``eval`` or ``saving`` line of
    step ``step``."""
    event, step = point["event"], point["step"]
    if event == "step":
        return record.get("event") == "step" and record["step"] >= step
    if event == "backward":
        return record.get("event") == "backward" and record["step"] == step + 1 and record.get("n") == 1
    return record.get("event") == event and record.get("step") == step
