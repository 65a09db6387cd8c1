"""Positions saved by several readers, merged, and the marks of a packer or a filter (pure: the command line
reads them without torch).

A share's marks (``sources._global``) are ``(index, *mark)`` flattened, each ``mark_width`` ints wide: 3 for a
``Packed`` (the next token's document and offset) and a ``Filtered`` (the source items drawn and kept), 4 for
a ``Packed`` over a ``Filtered`` (and the filter's items drawn when the packer read its last document). The
width is fixed for an epoch by its first marks and saved where it is not 3 (``"mark_width"``); a state without
it, every one written before widths were recorded, is 3 wide. This module is the one place that reads it.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from ..errors import CheckpointError

MARK_WIDTH = 3  # ints a mark takes, its index included, where a state does not say


def merge_positions(snapshots: Sequence[Optional[dict]]) -> dict:
    """Every part's position and whether it is done, gathered from readers' saved states."""
    positions: dict[str, Any] = {}
    done: set[int] = set()
    for snapshot in snapshots:
        if snapshot is None:
            continue
        state = snapshot["dataset"]
        positions.update(state["positions"])
        done.update(state["done"])
    return {"positions": positions, "done": sorted(done), "next": None}


def next_token(documents: int, offset: int, carried: bool) -> tuple[int, int]:
    """Where a packer's next token is, as (document of the epoch, offset in it): in the last of the ``documents``
    read, at ``offset``, while it has tokens left (``carried``); else at the start of the next one."""
    return (documents - 1, offset) if carried else (documents, 0)


def drawn_kept(kept: int, dropped: int) -> tuple[int, int]:
    """Where a filter stands, as (source items drawn this epoch, of which kept): its mark, and what its
    position says at its next index."""
    return kept + dropped, kept


def last_read(document: int, offset: int, drawn: int) -> tuple[int, int]:
    """At a mark ``(document, offset, drawn)`` of a packer over a filter: the last document the packer read and the
    filter's source item it was (``-1, -1`` before the first). A carried document has given a row at least one
    token (``offset > 0``), so the next token is in the last document read exactly where ``offset`` is not 0;
    the filter returns as soon as it keeps an item, so that document is the item drawn last then."""
    return (document if offset else document - 1), drawn - 1


def mark_width(state: Mapping[str, Any]) -> int:
    """The ints each of a share's marks takes, ``(index, *mark)``: its ``"mark_width"``, else 3."""
    return state.get("mark_width", MARK_WIDTH)


def mark_tuples(state: Mapping[str, Any]) -> list[tuple[int, ...]]:
    """A share's marks (of its saved source state) as tuples ``(index, *mark)``: ``(index, document, offset)``
    under a packer (:func:`next_token`), ``(index, drawn, kept)`` under a filter (:func:`drawn_kept`), ``(index,
    document, offset, drawn)`` under a packer over a filter (:func:`last_read`)."""
    marks, width = state.get("marks", []), mark_width(state)
    return [tuple(marks[i:i + width]) for i in range(0, len(marks), width)]


def epoch_mark_width(states: Sequence[Optional[Mapping[str, Any]]]) -> Optional[int]:
    """The width of an epoch's marks, from its shares' source states: fixed by the first share given one or
    holding marks; ``None`` while none is (each share then notes its cursor's own)."""
    for state in states:
        if state is not None and ("mark_width" in state or state.get("marks")):
            return mark_width(state)
    return None


def noting_width(state: Mapping[str, Any], mark: Optional[Sequence[int]]) -> int:
    """The width a share starting from ``state`` notes its marks in: the epoch's (:func:`epoch_mark_width`),
    else its cursor's own (``mark``: what the cursor's ``mark()`` says now). A cursor marks more than an epoch
    begun before that was recorded (a packer over a filter resumed from a checkpoint of 3-wide marks): it notes
    the first numbers of each mark for the rest of that epoch, which mean what they meant then."""
    width = epoch_mark_width([state])
    if mark is None:
        return width or MARK_WIDTH
    if width is not None and width > 1 + len(mark):
        raise CheckpointError(
            f"the checkpoint's source noted marks of {width - 1} numbers, this one's cursor notes {len(mark)}: it "
            "is not the source the checkpoint was written with; resume with that source, or start a fresh run"
        )
    return width or 1 + len(mark)


def merge_marks(datasets: Sequence[Optional[dict]]) -> list[int]:
    """Every share's marks of the epoch, from their saved source states, merged in index order (flattened, in the
    epoch's width, which every share's marks have)."""
    widths = {mark_width(d) for d in datasets if d is not None and d.get("marks")}
    if len(widths) > 1:
        raise CheckpointError(
            f"the checkpoint's worker shares noted marks of different widths ({sorted(widths)}) in one epoch; it "
            "was not written by this package's loaders: resume from another checkpoint, or start a fresh run"
        )
    found = {mark for dataset in datasets if dataset is not None for mark in mark_tuples(dataset)}
    return [value for mark in sorted(found) for value in mark]
