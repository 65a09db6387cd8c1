"""A mixture's position: its start, its validation (in the user's terms), and finding it in a loader's state."""

from __future__ import annotations

import array
import copy
import json
from typing import Any, Iterator, Mapping

from ..errors import CheckpointError, UnsupportedConfigError
from .schedule import plan_names

_KEYS = ("next", "schedule", "sources", "drawn", "delivered", "restarts")
_COUNTS = ("drawn", "delivered", "restarts")
_NO_TOKENS = (int, float, str, bytes, type(None))
_OPTIONAL = ("tokens",)  # added later: a checkpoint written before has none (read as 0)


def start_position(names: list[str], plan: Any) -> dict:
    """The position before an epoch's first sample, drawing with ``plan`` (recorded weights or schedule)."""
    return {
        "next": 0,
        "schedule": [[0, plan]],
        "sources": dict.fromkeys(names),
        "drawn": dict.fromkeys(names, 0),
        "delivered": dict.fromkeys(names, 0),
        "restarts": dict.fromkeys(names, 0),
        "tokens": dict.fromkeys(names, 0),
    }


def token_count(item: Any) -> int:
    """The tokens of an item: the length of a list, tuple, array or 1-d tensor of token ids, or of a mapping's
    ``input_ids``; 0 for an item without one (an image, a string, a number)."""
    if isinstance(item, _NO_TOKENS):  # first: the cheap checks of the common items (the mixture counts every one)
        return 0
    if isinstance(item, (dict, Mapping)):
        item = item.get("input_ids")
    if isinstance(item, (list, tuple, array.array)):
        return len(item)
    shape = getattr(item, "shape", None)  # a tensor's (torch.Size is a tuple) or a numpy array's
    return int(shape[0]) if isinstance(shape, tuple) and len(shape) == 1 else 0


def checked_position(position: Any, names: list[str]) -> dict:
    """A copy of a saved position over this mixture's ``names``, or a refusal.

    A source added since the checkpoint starts at its beginning (the saved schedule never drew from it); a
    source removed is refused, since its position would be lost.
    """
    if not isinstance(position, Mapping) or any(key not in position for key in _KEYS) or not _well_formed(position):
        raise CheckpointError(
            f"the saved position of a Mixture is not one it wrote (got {str(position)[:200]}); resume from a "
            "checkpoint written with this Mixture, or start the run without loading"
        )
    removed = sorted(set(position["sources"]) - set(names))
    if removed:
        raise CheckpointError(
            f"the checkpoint's Mixture has the source(s) {removed}, which this Mixture does not have (its sources: "
            f"{names}); pass them again, with weight 0 to stop drawing from them, so their positions are kept"
        )
    found = {key: copy.deepcopy(position[key]) for key in _KEYS}
    found["tokens"] = dict(position.get("tokens") or {})
    for name in names:
        found["sources"].setdefault(name, None)
        for key in _COUNTS + _OPTIONAL:
            found[key].setdefault(name, 0)
    return found


def _well_formed(position: Mapping[str, Any]) -> bool:
    """Every field as the mixture writes it: weights finite and >= 0 (one > 0), counts whole and >= 0, the same
    source names in ``sources`` and in every count (a source missing from ``sources`` would restart)."""
    schedule = position["schedule"]
    entries_ok = isinstance(schedule, list) and bool(schedule) and all(
        isinstance(entry, (list, tuple)) and len(entry) == 2 and _count(entry[0]) for entry in schedule
    )
    if not entries_ok or schedule[0][0] != 0 or any(a[0] > b[0] for a, b in zip(schedule, schedule[1:])):
        return False
    counts = _COUNTS + tuple(key for key in _OPTIONAL if key in position)
    if not all(isinstance(position[key], Mapping) for key in counts + ("sources",)):
        return False
    names = set(position["sources"])
    try:  # (a source added later is in later entries only)
        if any(not plan_names(plan) <= names for _, plan in schedule):
            return False
    except (UnsupportedConfigError, ValueError, TypeError, KeyError):
        return False
    if "seed" in position and (isinstance(position["seed"], bool) or not isinstance(position["seed"], int)):
        return False
    counts_ok = all(set(position[key]) == names and all(map(_count, position[key].values())) for key in counts)
    return counts_ok and _count(position["next"])


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def schedule_of(positions: list[dict]) -> list:
    """The schedule every share's position holds: the shares of one pass always agree on it."""
    schedules = {json.dumps(position["schedule"], sort_keys=True) for position in positions}
    if len(schedules) > 1:
        raise CheckpointError(
            f"the saved worker shares of a Mixture disagree on its weight schedule ({sorted(schedules)}); they were "
            "not saved by one run; resume from another checkpoint"
        )
    return copy.deepcopy(positions[0]["schedule"])


def mixture_positions(state: Any) -> Iterator[dict]:
    """The mixture positions in ``state``: a mixture's ``state_dict()``, a list of them, or a loader's state."""
    if isinstance(state, list):
        for part in state:
            yield from mixture_positions(part)
    elif isinstance(state, Mapping):
        position = state.get("position")
        if {"index", "position"} <= set(state) <= {"index", "position", "skip", "block", "origin"}:  # a GlobalStream's
            if isinstance(position, Mapping) and "delivered" in position:
                yield position
        elif isinstance(state.get("stream"), Mapping):  # a stream loader: each logical worker's snapshot
            for snapshot in state["stream"].get("snapshots") or []:
                if isinstance(snapshot, Mapping) and "dataset" in snapshot:
                    yield from mixture_positions(snapshot["dataset"])
        elif isinstance(state.get("base"), Mapping):  # the dispatcher: its reader's state
            yield from mixture_positions(state["base"])


def source_counts(state: Any) -> dict[str, dict[str, int]]:
    """Per source, the samples and the tokens (:func:`token_count`) delivered in the epoch, summed over the
    mixture positions of ``state`` (see :func:`mixture_positions`); ``{}`` when it holds none."""
    totals: dict[str, dict[str, int]] = {}
    for position in mixture_positions(state):
        for key, counts in (("samples", position["delivered"]), ("tokens", position.get("tokens") or {})):
            for name, count in counts.items():
                found = totals.setdefault(name, {"samples": 0, "tokens": 0})
                found[key] += int(count)
    return {name: totals[name] for name in sorted(totals)}
