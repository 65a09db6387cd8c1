"""Which documents a ``Packed`` stream's steps were cut from, from the checkpoint alone (``samples``).

A packed row's documents depend on their lengths, which are data. What the checkpoint holds instead: every
worker share of the outermost ``Packed`` notes, at the end of each block it hands out (a worker batch), where
the sequence stands as the next token's (document, offset) (``sources._global``: ``marks``), and its own
position says the same at its next index. The steps a rank takes are runs of blocks, so the rows of a step
lie between two such points; the step then holds the documents between them: the first from its offset on,
the last up to its offset, the ones between whole (an empty document among them adds nothing). A document's
number is the packer's count of its source's items this epoch, which the source's own position names
(``_composed``: a mixture's source and document, a map-style dataset's index). Over a ``Filtered`` those
are the filter's kept items, and the marks also hold the filter's draws, which name the source items they
were (``_packed_filtered``).

Where a rank's part of a step starts or ends inside a block (the shard loader cuts each global batch between
the ranks; the dispatcher with ``split_batches``), the rows of the whole step are named, for all ranks
together. Rows left out by ``skip_samples`` are read but not trained, so a step around them is refused, as
is a checkpoint written before packers counted their documents.
"""

from __future__ import annotations

from typing import Any, Optional

from ..sources._merge import MARK_WIDTH, epoch_mark_width, mark_tuples, next_token
from ._composed import _source_items, is_packed
from ._packed_filtered import kept_documents
from ._read import NotAnswerable
from ._streams import Layout, marked_span


def step_pieces(layout: Layout, datasets: list, step: int) -> dict:
    """``{"indices", "rows", "pieces"}`` of the rank's ``step``: its row indices, whose rows the pieces are
    (``"this rank"`` or ``"all ranks"``), and each piece ``{"source", "document", "start", "stop"}`` (token
    offsets in the document; ``stop`` ``None``: to its end). Over a ``Filtered`` whose draws the marks hold
    (``_packed_filtered``), each piece also has ``"item"`` (the filter's kept item it is) and ``"between": True``
    where its document is one of those kept among the draws of ``"between"``, which the answer then has too."""
    points = _points(datasets)
    rows, span, scope = marked_span(layout, step, set(points), "packed rows", "the documents of a packed step")
    missing = [k for k in span if k not in points]
    if missing:
        raise NotAnswerable(
            f"the checkpoint does not record where the packed sequence stood at row {missing[0]}, the "
            f"{'start' if missing[0] == span[0] else 'end'} of step {step}: it was written before packers noted "
            "the documents at each worker batch's end, so which documents a row was cut from is not known"
        )
    before, after = points[span[0]], points[span[1]]
    (first, start), (last, stop) = before[:2], after[:2]
    documents = list(range(first, last + (1 if stop else 0)))
    source, found = _furthest(datasets), {"indices": rows, "rows": scope}
    if len(before) > 2:  # over a Filtered: the documents are its kept items, named from its draws
        named, found["between"] = kept_documents(before, after, source and source["source"], step, layout.epoch)
        items = [dict(named.get(d, {"source": None, "document": None, "between": True}), item=d) for d in documents]
    else:
        items = _source_items(source, None, documents, layout.epoch) if documents else []
    found["pieces"] = [dict(item, start=start if document == first else 0, stop=stop if document == last else None)
                       for document, item in zip(documents, items)]
    return found


def _points(datasets: list) -> dict[int, tuple[int, ...]]:
    """Row index -> the next token's (document, offset) there, and over a filter its draws (``_merge.mark_tuples``),
    from every share's marks, and in an epoch of 3-wide marks its position (a checkpoint written before packers
    noted marks has none; one of wider marks has them at every block's end)."""
    width = epoch_mark_width(datasets) or MARK_WIDTH
    found: dict[int, tuple[int, ...]] = {0: (0,) * (width - 1)}  # an epoch's first row starts its first document
    for dataset in datasets:
        if dataset is None:
            continue
        found.update({mark[0]: mark[1:] for mark in mark_tuples(dataset)})
        position = dataset["position"]
        if is_packed(position) and width == MARK_WIDTH:
            found[dataset["index"]] = next_token(position["documents"], position["offset"], bool(position["carry"]))
    return found


def _furthest(datasets: list) -> Optional[Any]:
    """The source position of the share whose packer read furthest: it names every document read before."""
    found = [d["position"] for d in datasets if d is not None and is_packed(d["position"])]
    return max(found, key=lambda p: p["documents"])["source"] if found else None
