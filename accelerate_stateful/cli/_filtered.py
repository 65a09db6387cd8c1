"""Which source items a ``Filtered`` stream's steps drew, from the checkpoint alone (``samples``).

Which items a filter keeps is its predicate's answer on the data, which the checkpoint does not hold. What it
holds instead: every worker share of the outermost ``Filtered`` notes, at the end of each block it hands out
(a worker batch), the source items drawn this epoch and how many of them were kept (``sources._global``:
``marks``), and its own position says the same at its next index. The steps a rank takes are runs of blocks,
so the rows of a step lie between two such points: they are the items the predicate kept among the source
items drawn between them, as many as the step's rows. Those drawn items are named by their number in the
source's order this epoch, which the source's own position names (``_composed``: a mixture's source and
document, a map-style dataset's index); which of them were kept, the predicate decides (run it on them).

Where a rank's part of a step starts or ends inside a block (the shard loader cuts each global batch between
the ranks; the dispatcher with ``split_batches``), the draws of the whole step are named, for all ranks
together. Rows left out by ``skip_samples`` are read but not trained, so a step around them is refused, as
is a step whose ends a checkpoint written before filters noted their draws does not record.
"""

from __future__ import annotations

from typing import Any, Optional

from ..sources._merge import drawn_kept
from ._composed import _source_items, is_filtered
from ._read import NotAnswerable
from ._streams import Layout, MarkWords, furthest, marked_points, marked_step


_WORDS = MarkWords(rows="filtered rows", names="the draws of a filtered step",
                   stood="how many source items the Filtered had drawn", noted="filters noted their draws",
                   unknown="which source items the step's rows were kept from")


def step_draws(layout: Layout, datasets: list, step: int) -> dict:
    """``{"indices", "rows", "drawn", "kept", "dropped"}`` of the rank's ``step``: its row indices, whose rows the
    draws are (``"this rank"`` or ``"all ranks"``), each source item drawn for them ``{"source", "document"}`` in
    the order drawn, and how many of those the predicate kept (the rows) and dropped."""
    rows, scope, span, (first, kept_before), (stop, kept_after) = marked_step(layout, step, _points(datasets), _WORDS)
    kept = kept_after - kept_before
    if kept != span[1] - span[0] or stop - first < kept:
        raise NotAnswerable(
            f"the checkpoint's Filtered counts disagree with its rows: step {step} holds {span[1] - span[0]} rows, "
            f"but the filter kept {kept} of the {stop - first} source items it drew for them; the checkpoint is "
            "damaged or not written by this package's loaders"
        )
    drawn = list(range(first, stop))
    named = _source_items(furthest(datasets, _drawn), None, drawn, layout.epoch) if drawn else []
    return {"indices": rows, "rows": scope, "drawn": named, "kept": kept, "dropped": len(drawn) - kept}


def _drawn(position: Any) -> Optional[int]:
    """A filter's source items drawn this epoch, from its position (``None``: not a filter's)."""
    return drawn_kept(position["kept"], position["dropped"])[0] if is_filtered(position) else None


def _points(datasets: list) -> dict[int, tuple]:
    """Row index -> (source items drawn, of which kept) there, from every share's marks and position (an epoch's
    first row: nothing drawn yet)."""
    return marked_points(datasets, (0, 0), lambda p: drawn_kept(p["kept"], p["dropped"]) if is_filtered(p) else None)
