"""The conformance harness: an uninterrupted run against runs interrupted at any save point.

Every loader variant goes through the same checks. A *save point* is a
place between two batches handed to the training loop, written as
``(batches_taken, where)``: ``where`` is ``"in_loop"`` (saved right after
that batch, inside ``for batch in dl``) or ``"after_loop"`` (saved after the
inner loop ended, which only exists at an epoch's end).

The loop shape is the one the README teaches::

    for epoch in range(dl.epoch, epochs):
        for batch in dl:
            ...
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from accelerate_stateful.checkpoint import _files

SavePoint = tuple[int, str]


@dataclass(frozen=True)
class Step:
    """What the training loop saw at one batch."""

    epoch: int
    ids: tuple
    end_of_dataloader: bool


def batch_ids(batch: Any) -> tuple:
    if isinstance(batch, dict):
        batch = batch["id"]
    if isinstance(batch, (list, tuple)):
        batch = batch[0]
    return tuple(torch.as_tensor(batch).tolist())


# The pass a stop inside the loop leaves live (the newest only: an older one may end, its run is over).
_KILLED: list = []


def run_loop(
    loader: Any, epochs: int, stop: Optional[SavePoint] = None, taken: int = 0
) -> tuple[list[Step], Optional[dict]]:
    """Drive ``loader`` like a training loop; stop at ``stop`` and return the steps and the state there.

    ``taken`` is how many batches earlier runs already took, so save points count from the run's start.
    """
    steps: list[Step] = []
    if stop == (taken, "in_loop") or stop == (taken, "before"):
        return steps, loader.state_dict()
    for epoch in range(loader.epoch, epochs):
        passing = iter(loader)
        for batch in passing:
            steps.append(Step(epoch, batch_ids(batch), bool(loader.end_of_dataloader)))
            if stop == (taken + len(steps), "in_loop"):
                _KILLED[:] = [passing]  # the process is killed right after this save: the pass never ends
                return steps, loader.state_dict()
        if stop == (taken + len(steps), "after_loop"):
            return steps, loader.state_dict()
    return steps, None


def through_files(state: dict, rank: int = 0) -> dict:
    """The state after a round trip through the on-disk format."""
    with tempfile.TemporaryDirectory() as tmp:
        _files.write_loader_state(Path(tmp), 0, rank, state)
        return _files.read_loader_state(Path(tmp), 0, rank)


def epoch_end_counts(reference: Sequence[Step]) -> list[int]:
    """Batch counts at which an epoch ends in the reference run."""
    return [i + 1 for i, step in enumerate(reference) if step.end_of_dataloader]


def save_points(reference: Sequence[Step]) -> list[SavePoint]:
    """Before the first batch, after the first, mid-epoch, before and after the last, epoch ends, later epochs."""
    total = len(reference)
    ends = epoch_end_counts(reference)
    counts = {0, 1, total // 2, max(total - 1, 0), total}
    for end in ends:
        counts.update({end - 1, end, end + 1})
    if ends:
        counts.add(ends[0] + max((ends[-1] - ends[0]) // 2, 1))
    points = [(c, "in_loop") for c in sorted(counts) if 0 <= c <= total]
    points += [(end, "after_loop") for end in ends]
    return points


def check_resumes(
    make_loader: Callable[[], Any],
    epochs: int,
    chains: Sequence[Sequence[SavePoint]],
    reference: Optional[list[Step]] = None,
    rank: int = 0,
) -> list[Step]:
    """Assert that every chain of successive save-and-resume equals the uninterrupted run.

    Each link of a chain builds a fresh loader, loads the previous state (through
    the on-disk format) and runs to the next save point; the last link runs to the end.
    Chains of one point share the run that saves (``_check_single_resumes``).
    """
    if reference is None:
        reference, _ = run_loop(make_loader(), epochs)
    singles = sorted({chain[0] for chain in chains if len(chain) == 1}, key=_order)
    if singles:
        _check_single_resumes(make_loader, epochs, singles, reference, rank)
    for chain in chains:
        if len(chain) == 1:
            continue
        seen: list[Step] = []
        state = None
        for stop in list(chain) + [None]:
            loader = make_loader()
            if state is not None:
                loader.load_state_dict(through_files(state, rank))
            steps, state = run_loop(loader, epochs, stop, taken=len(seen))
            seen += steps
            if stop is not None:
                assert state is not None, f"save point {stop} never reached; the run took {len(seen)} batches"
        assert_same_stream(reference, seen, chain)
    return reference


def _order(point: SavePoint) -> tuple[int, int]:
    """Save points in the order a run meets them: at a count, inside the loop before after it."""
    return point[0], point[1] == "after_loop"


def _check_single_resumes(make_loader: Callable[[], Any], epochs: int, points: Sequence[SavePoint],
                          reference: list[Step], rank: int) -> None:
    """Chains of one save point each, from one run that saves at every point and goes on (what it hands out must
    still be the uninterrupted run's: a save is a query), instead of a run to each point: the same resumes, each
    from a fresh loader given the state through the on-disk format, at half the batches."""
    steps, states = _saving_run(make_loader(), epochs, points, rank)
    assert_same_stream(reference, steps, f"a run saving at {list(points)}")
    missing = [point for point in points if point not in states]
    assert not missing, f"save points {missing} never reached; the run took {len(steps)} batches"
    for point in points:
        loader = make_loader()
        loader.load_state_dict(states[point])
        resumed, _ = run_loop(loader, epochs, taken=point[0])
        assert_same_stream(reference, reference[: point[0]] + resumed, [point])


def _saving_run(loader: Any, epochs: int, points: Sequence[SavePoint], rank: int) -> tuple[list[Step], dict]:
    """Drive ``loader`` to the end like :func:`run_loop`, taking its state at each of ``points`` through the
    on-disk format (as it was when taken, whatever the loader changes later)."""
    steps: list[Step] = []
    states: dict = {}
    wanted = set(points)

    def save(where: str) -> None:
        if (len(steps), where) in wanted:
            states[(len(steps), where)] = through_files(loader.state_dict(), rank)

    save("in_loop")  # before the first batch
    save("before")
    for epoch in range(loader.epoch, epochs):
        for batch in loader:
            steps.append(Step(epoch, batch_ids(batch), bool(loader.end_of_dataloader)))
            save("in_loop")
        save("after_loop")
    return steps, states


def assert_same_stream(reference: Sequence[Step], seen: Sequence[Step], chain: Any) -> None:
    for i, (want, got) in enumerate(zip(reference, seen)):
        assert want == got, f"resume chain {chain}: batch {i} differs: expected {want}, got {got}"
    assert len(seen) == len(reference), (
        f"resume chain {chain}: {len(seen)} batches after resuming, uninterrupted run has {len(reference)}"
    )
