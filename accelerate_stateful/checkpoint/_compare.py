"""What every process must share: for a checkpoint to be sealed, and for it to be merged on another topology.

- **What defines the data** (:func:`data_digest`): the shuffle seed, and every setting of the composable
  sources (a ``Mixture``'s weights, a ``Packed`` source's ``seq_len`` ...), with each pass's weight schedule.
  Read from the objects, never by a collective in ``next()``; compared by every save and load
  (``_in_step.settle``), which refuses on every rank, naming what differs and the fix.
- **The point** (:func:`shared_point`): the epoch, the samples every process took, where the epoch was
  re-cut, and the pass in progress (where it began, whether it was trained). The elastic merge
  (:func:`merged_state`, which ``DataLoaderAdapter.merge_rank_states`` and the command line's ``samples
  --world-size`` use) compares the saved states with :func:`first_difference` and names what differs. The save
  does not: a rank's share of a stream may end a batch before another's (uneven shares), and such a checkpoint
  resumes exactly on the same number of processes.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping, Optional, Sequence

from . import _refusals
from . import _state as S
from ..errors import CheckpointError
from ..loaders._passes import PASS
from ..sources._mixture_state import mixture_positions

_SHARED = (S.EPOCH, S.SAMPLES_CONSUMED, S.STRIPE_ORIGIN, PASS)
_IN_WORDS = {
    S.EPOCH: "the epoch",
    S.SAMPLES_CONSUMED: "the samples taken in the epoch",
    S.STRIPE_ORIGIN: "where the epoch was cut again into batches of this run's size",
    PASS: "the pass in progress (where it began, and whether it was trained)",
}


def shared_point(state: Any) -> tuple:
    """The part of a loader's saved state that every process must share, as ``(field, value)`` pairs."""
    return tuple((key, _comparable(state, key)) for key in _SHARED)


def first_difference(points: Sequence[tuple]) -> Optional[tuple[int, str]]:
    """``(rank, what differs in words)`` for the first rank whose :func:`shared_point` is not rank 0's, else
    ``None``."""
    for rank, point in enumerate(points[1:], start=1):
        for (key, value), (_, first) in zip(point, points[0]):
            if value != first:
                return rank, _IN_WORDS[key]
    return None


def merged_state(states: Sequence[Any], merge_marks: Optional[Callable[[list], Mapping[str, Any]]] = None
                 ) -> Mapping[str, Any]:
    """The one state to resume from on another topology, from every saved rank's state: the main process's,
    once every rank is known to agree on the epoch, the position and the pass that was live; a live pass's
    starting point is merged the same way (by ``merge_marks``, the loader's own merge where it has one)."""
    differs = first_difference([shared_point(state) for state in states])
    if differs is not None:
        rank, what = differs
        raise CheckpointError(
            f"cannot resume on another number of processes: the processes were at different points of the "
            f"data when it was saved ({what} differs: rank 0 at {_refusals.where(states[0])}; rank {rank} at "
            f"{_refusals.where(states[rank])}), so no single position can be re-dealt to the new processes; "
            "resume it on the same number of processes, or from a checkpoint saved while the processes were in "
            "step"
        )
    entry = states[0].get(PASS) if isinstance(states[0], Mapping) else None
    if not isinstance(entry, Mapping) or not isinstance(entry.get("origin"), Mapping) or \
            entry["origin"].get("mark") is None:
        return states[0]
    mark = (merge_marks or merged_state)([state[PASS]["origin"]["mark"] for state in states])
    origin = dict(entry["origin"], mark=mark)
    return dict(states[0], **{PASS: dict(entry, origin=origin)})


def data_digest(loader: Any) -> list[tuple[str, Any, str]]:
    """``(what, value, fix)`` for everything that defines ``loader``'s data (see the module docstring)."""
    # Not the loader's own settings (batch size, dataset length): a rank may read its own split of the data
    # (``split_dataset_by_node``), and a rank whose settings differ from the checkpoint's is refused by the load.
    from ..sources._global import data_settings  # imports torch, which the command line's merge never needs

    rows = [
        ("the shuffle seed", loader.seed, "seed the DataLoader's generator (or data_seed) the same on every process"),
    ]
    for where, key, value in data_settings(loader.dataset):
        fix = ("call set_weights with the same weights on every process" if key == "weights" else
               f"build {where} with the same {key} on every process")
        rows.append((f"the {key} of {where}", value, fix))
    if loader.mode == S.STREAM_MODE:  # each process reads its own shares: each agreed one schedule per pass
        schedules = sorted({json.dumps(p["schedule"], sort_keys=True) for p in mixture_positions(loader._raw_state())})
        if schedules:
            rows.append(("the Mixture's weight schedule of the pass", schedules,
                         "call set_weights with the same weights on every process, at the same point"))
    return rows


def data_refusal(digests: Sequence[list], call: str, index: int) -> Optional[str]:
    """The refusal when the processes' :func:`data_digest` of loader ``index`` differ, else ``None``."""
    for row, (what, first, fix) in enumerate(digests[0]):
        values = [digest[row][1] if row < len(digest) else None for digest in digests]
        if any(value != first for value in values[1:]):
            seen = ", ".join(f"rank {rank}: {value}" for rank, value in enumerate(values))
            return f"{call} refused for loader {index}: {what} is not the same on every process ({seen}); {fix}"
    return None


def _comparable(state: Any, key: str) -> Any:
    """``state[key]``, with a live pass's starting point reduced to what every rank must share."""
    value = state.get(key) if isinstance(state, Mapping) else None
    if key == PASS and isinstance(value, Mapping) and isinstance(value.get("origin"), Mapping):
        origin = value["origin"]
        # Not the warm-up passes counted before it ("peeks"): a shape check on the main process only is undone
        # there, and each process re-runs its own after a resume; the merge keeps the main process's count.
        return (value.get("trained"), origin.get("epoch"), origin.get("phase"), origin.get("taken"),
                origin.get("mark") is None)
    return value
