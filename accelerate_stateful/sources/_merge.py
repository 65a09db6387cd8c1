"""Merging logical-shard positions saved by several readers (pure: the command line reads them without torch)."""

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
