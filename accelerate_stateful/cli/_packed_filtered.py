"""Which source items the documents of a ``Packed(Filtered(...))`` stream's steps were, from the checkpoint alone.

The packer's documents are the filter's kept items, and which items a filter keeps is its predicate's answer on
the data. What the checkpoint holds: at the end of each block, the packer's marks hold, beside the next token's
(document, offset), the filter's source items drawn when the packer read its last document, which that
document was (the filter returns as soon as it keeps an item: ``_merge.last_read``). So a step's rows, which lie
between two marks, hold:

- the document the packer had read last at each mark that is in the step (its last document, and its first
  where the step begins inside it), each the source item drawn last then: named exactly;
- the whole documents between those two, which the filter kept among the source items drawn between them: as
  many as the documents, in the order drawn. Where it kept every one of those items, each document is named
  exactly too; otherwise the drawn items are listed with how many were kept, and which ones were is the
  predicate's decision, as for an outermost ``Filtered`` (``_filtered``).

The items are named through the filter's source position, as every composed source is (``_composed``). A
checkpoint written before packers noted their filter's draws (marks of 3 numbers) names the documents by the
filter's item numbers, with the reason (``_packed``).
"""

from __future__ import annotations

from typing import Any

from ..sources._merge import last_read
from ._composed import _source_items
from ._read import NotAnswerable


def kept_documents(before: tuple[int, int, int], after: tuple[int, int, int], source: Any, step: int, epoch: int
                   ) -> tuple[dict[int, dict], dict]:
    """The source items of a step's documents, between the marks ``before`` and ``after`` (document, offset,
    drawn): ``({document: {"source", "document"}}`` for each document named exactly, ``{"drawn", "kept",
    "dropped"})`` for the whole documents between the two read last at the marks (``drawn``: every source item
    drawn for them, in the order drawn; ``kept``: how many documents they are). ``source`` is the filter's
    source position after the furthest draw, which names every item drawn before."""
    (known, item), (last, last_item) = last_read(*before), last_read(*after)
    between, drawn = range(known + 1, last), range(item + 1, last_item)
    if last < known or len(drawn) < len(between) or (last == known) != (last_item == item):
        raise NotAnswerable(
            f"the checkpoint's packer marks disagree at step {step}: its packer read documents {known} to {last} "
            f"while its filter drew source items {item} to {last_item}; the checkpoint is damaged or not written "
            "by this package's loaders"
        )
    items = {known: item, last: last_item}
    if len(drawn) == len(between):  # the filter kept every item drawn there: each is one of the documents
        items.update(zip(between, drawn))
    first = before[0]  # the step's first document: the one read last, or the next one
    items = {document: i for document, i in items.items() if document >= first}
    wanted = sorted(set(items.values()) | set(drawn))
    named = dict(zip(wanted, _source_items(source, None, wanted, epoch))) if wanted else {}
    return ({document: named[i] for document, i in items.items()},
            {"drawn": [named[i] for i in drawn], "kept": len(between), "dropped": len(drawn) - len(between)})
