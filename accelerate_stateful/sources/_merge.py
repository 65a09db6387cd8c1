"""Positions saved by several readers, merged, and the marks of a packer or a filter (pure: the command line
reads them without torch)."""

from __future__ import annotations

from typing import Any, Optional, Sequence


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


def mark_triples(marks: Sequence[int]) -> list[tuple[int, int, int]]:
    """A share's marks (``sources._global``: ``(index, *mark)`` flattened) as triples: ``(index, document,
    offset)`` under a packer (:func:`next_token`), ``(index, drawn, kept)`` under a filter (:func:`drawn_kept`)."""
    return [tuple(marks[i:i + 3]) for i in range(0, len(marks), 3)]


def merge_marks(datasets: Sequence[Optional[dict]]) -> list[int]:
    """Every share's marks of the epoch, from their saved source states, merged in index order (flattened)."""
    found = {triple for dataset in datasets if dataset is not None for triple in mark_triples(dataset.get("marks", []))}
    return [value for triple in sorted(found) for value in triple]
