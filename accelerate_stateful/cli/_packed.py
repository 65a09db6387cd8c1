"""Which documents a ``Packed`` stream's steps were cut from, from the checkpoint alone (``samples``).

A packed row's documents depend on their lengths, which are data. What the checkpoint holds instead: every
worker share of the outermost ``Packed`` notes, at the end of each block it hands out (a worker batch), where
the sequence stands as the next token's (document, offset) (``sources._global``: ``marks``), and its own
position says the same at its next index. The steps a rank takes are runs of blocks, so the rows of a step
lie between two such points; the step then holds the documents between them: the first from its offset on,
the last up to its offset, the ones between whole (an empty document among them adds nothing). A document's
number is the packer's count of its source's items this epoch, which the source's own position names
(``_composed``: a mixture's source and document, a map-style dataset's index).

Where a rank's part of a step starts or ends inside a block (the shard loader cuts each global batch between
the ranks; the dispatcher with ``split_batches``), the rows of the whole step are named, for all ranks
together. Rows left out by ``skip_samples`` are read but not trained, so a step around them is refused, as
is a checkpoint written before packers counted their documents.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ..sources._merge import mark_triples, next_token
from ._composed import _source_items, is_packed
from ._read import NotAnswerable
from ._streams import Layout, marked_span


def step_pieces(layout: Layout, datasets: list, step: int) -> dict:
    """``{"indices", "rows", "pieces"}`` of the rank's ``step``: its row indices, whose rows the pieces are
    (``"this rank"`` or ``"all ranks"``), and each piece ``{"source", "document", "start", "stop"}`` (token
    offsets in the document; ``stop`` ``None``: to its end)."""
    points = _points(datasets)
    rows, span, scope = marked_span(layout, step, set(points), "packed rows", "the documents of a packed step")
    missing = [k for k in span if k not in points]
    if missing:
        raise NotAnswerable(
            f"the checkpoint does not record where the packed sequence stood at row {missing[0]}, the "
            f"{'start' if missing[0] == span[0] else 'end'} of step {step}: it was written before packers noted "
            "the documents at each worker batch's end, so which documents a row was cut from is not known"
        )
    (first, start), (last, stop) = points[span[0]], points[span[1]]
    documents = list(range(first, last + (1 if stop else 0)))
    named = _source_items(_furthest(datasets), None, documents, layout.epoch) if documents else []
    pieces = []
    for document, item in zip(documents, named):
        piece = dict(item, start=start if document == first else 0, stop=stop if document == last else None)
        pieces.append(piece)
    return {"indices": rows, "rows": scope, "pieces": pieces}


def _points(datasets: list) -> dict[int, tuple[int, int]]:
    """Row index -> the next token's (document, offset) there, from every share's marks and position."""
    found: dict[int, tuple[int, int]] = {0: (0, 0)}  # an epoch's first row starts its first document
    for dataset in datasets:
        if dataset is None:
            continue
        found.update({index: (document, offset) for index, document, offset in mark_triples(dataset.get("marks", []))})
        position = dataset["position"]
        if is_packed(position):
            found[dataset["index"]] = next_token(position["documents"], position["offset"], bool(position["carry"]))
    return found


def _furthest(datasets: list) -> Optional[Any]:
    """The source position of the share whose packer read furthest: it names every document read before."""
    found = [d["position"] for d in datasets if d is not None and is_packed(d["position"])]
    return max(found, key=lambda p: p["documents"])["source"] if found else None
