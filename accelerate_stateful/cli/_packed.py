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

from ..sources._merge import MARK_WIDTH, epoch_mark_width, next_token
from ._composed import _source_items, is_packed
from ._packed_filtered import kept_documents
from ._streams import Layout, MarkWords, furthest, marked_points, marked_step

_WORDS = MarkWords(rows="packed rows", names="the documents of a packed step",
                   stood="where the packed sequence stood", noted="packers noted the documents",
                   unknown="which documents a row was cut from")


def step_pieces(layout: Layout, datasets: list, step: int) -> dict:
    """``{"indices", "rows", "pieces"}`` of the rank's ``step``: its row indices, whose rows the pieces are
    (``"this rank"`` or ``"all ranks"``), and each piece ``{"source", "document", "start", "stop"}`` (token
    offsets in the document; ``stop`` ``None``: to its end). Over a ``Filtered`` whose draws the marks hold
    (``_packed_filtered``), each piece also has ``"item"`` (the filter's kept item it is) and ``"between": True``
    where its document is one of those kept among the draws of ``"between"``, which the answer then has too."""
    rows, scope, _, before, after = marked_step(layout, step, _points(datasets), _WORDS)
    (first, start), (last, stop) = before[:2], after[:2]
    documents = list(range(first, last + (1 if stop else 0)))
    source = furthest(datasets, lambda p: p["documents"] if is_packed(p) else None)
    found = {"indices": rows, "rows": scope}
    if len(before) > 2:  # over a Filtered: the documents are its kept items, named from its draws
        named, found["between"] = kept_documents(before, after, source and source["source"], step, layout.epoch)
        items = [dict(named.get(d, {"source": None, "document": None, "between": True}), item=d) for d in documents]
    else:
        items = _source_items(source, None, documents, layout.epoch) if documents else []
    found["pieces"] = [dict(item, start=start if document == first else 0, stop=stop if document == last else None)
                       for document, item in zip(documents, items)]
    return found


def _points(datasets: list) -> dict[int, tuple]:
    """Row index -> the next token's (document, offset) there, and over a filter its draws (``_merge.mark_tuples``),
    from every share's marks, and in an epoch of 3-wide marks its position (a checkpoint written before packers
    noted marks has none; one of wider marks has them at every block's end)."""
    width = epoch_mark_width(datasets) or MARK_WIDTH

    def here(position: Any) -> Optional[tuple]:
        if not is_packed(position) or width != MARK_WIDTH:
            return None
        return next_token(position["documents"], position["offset"], bool(position["carry"]))

    return marked_points(datasets, (0,) * (width - 1), here)  # an epoch's first row starts its first document
