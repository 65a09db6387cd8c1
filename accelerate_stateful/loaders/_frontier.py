"""An epoch of a composable source resumed on another number of workers or another batch: the blocks start again.

Every share of an epoch deals the sequence in blocks of ``b`` items from index ``origin``
(``sources._global``), one block a batch, and the loader takes the shares' batches in turn. So the batches
taken are the blocks ``0 .. T - 1`` (``T`` batches in all), and the share that handed out block ``T - 1``
stands at the sequence's position right after it: the first item no share handed out. From there the rest of
the epoch is the sequence's own rest. A loader with another number of workers, or another batch, deals it in
its own blocks from that index (the new ``origin``), so it hands out the batches a run without workers would,
batch for batch when the global batch is the same.

When the batches taken are not such a prefix (an epoch continued from another block, items left out in it, a
share that ended, a checkpoint of an item-by-item split), nothing is regrouped: the saved shares go on as they
are, each sample still once. The decision reads only the saved position, so every rank makes the same.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ._snapshot import unpack
from ..sources._merge import merge_marks


def frontier(stream: Mapping[str, Any]) -> Optional[tuple[dict, int, int, int]]:
    """The snapshot of the sequence at the first item no share handed out, that item's index, and the epoch's
    origin and block so far, when the batches taken are the blocks before it; else ``None``."""
    taken, rotation = list(stream["taken"]), stream.get("rotation", 0)
    shares, total = len(taken), sum(taken)
    states = [None if snap is None else unpack(snap) for snap in stream["snapshots"]]
    datasets = [None if state is None else state.get("dataset") for state in states]
    if not datasets or any(not isinstance(d, Mapping) for d in datasets if d is not None):
        return None
    found = [d for d in datasets if d is not None]
    if not found or any(d.get("skip") for d in found):
        return None
    blocks, origins = {d.get("block", 1) for d in found}, {d.get("origin", 0) for d in found}
    if len(blocks) != 1 or len(origins) != 1 or rotation != total % shares:
        return None
    block, origin = blocks.pop(), origins.pop()
    if total == 0:  # regrouped, then saved before any batch: every share still at the origin
        if len(found) == shares and all(d["index"] == origin for d in found):
            return states[0], origin, origin, block
        return None
    for w in range(shares):
        expected = -(-(total - w) // shares) if total > w else 0  # its blocks w, w + shares, ... below ``total``
        if taken[w] != expected:
            return None
        if expected and (states[w] is None or states[w].get("ended")
                         or datasets[w]["index"] != origin + (w + shares * (expected - 1) + 1) * block):
            return None
    return states[(total - 1) % shares], origin + total * block, origin, block


def regrouped(snapshot: dict, start: int, block: int, shares: int, marks: list) -> list[dict]:
    """``shares`` starting snapshots, each the sequence at ``start``, dealt in blocks of ``block`` from there; the
    first holds the epoch's ``marks`` so far (:func:`marks_of`), the others go on with none."""
    dataset = dict(snapshot["dataset"], index=start, origin=start, block=block)
    dataset.pop("skip", None)
    dataset.pop("marks", None)
    found = [dict(snapshot, dataset=dict(dataset)) for _ in range(shares)]
    if marks:
        found[0]["dataset"]["marks"] = list(marks)
    return found


def marks_of(stream: Mapping[str, Any]) -> list[int]:
    """Every share's marks of the epoch (``sources._global``: where the sequence stood at the end of each block
    a share handed out), merged in index order."""
    datasets = [None if snap is None else unpack(snap).get("dataset") for snap in stream["snapshots"]]
    return merge_marks([d if isinstance(d, Mapping) else None for d in datasets])
