"""The loader's side of :meth:`GlobalStream.agree`: the shares' starting snapshots, agreed before a pass.

A source whose shares must agree on something (a ``Mixture``'s weight change: every share must switch at
the same global sample, or the shares' per-source cursors drift apart) sees every share's starting
position in the main process, at the start of every pass, identically on every rank (and under the
dispatcher, on the rank that reads). The snapshots it returns are what the workers load, persistent ones
too, so a setting changed in the main process reaches every share.
"""

from __future__ import annotations

from typing import Any, Optional

from ._snapshot import unpack
from ..sources._global import GlobalStream, agree_states


def agree_snapshots(dataset: Any, snapshots: list[Optional[dict]]) -> tuple[list[Optional[dict]], list[str]]:
    """The snapshots each logical worker starts the pass from, and the lines to log (see the module docstring).

    Args:
        dataset: The stream the workers read.
        snapshots: Per logical worker, the snapshot it starts from (``None``: the epoch's start).
    """
    if not isinstance(dataset, GlobalStream) or type(dataset).agree is GlobalStream.agree:
        return snapshots, []
    found = [None if snap is None else unpack(snap) for snap in snapshots]
    states, lines = agree_states(dataset, [None if snap is None else snap["dataset"] for snap in found])
    agreed = [
        None if state is None else dict(snap or {"items": 0, "ended": False}, dataset=state)
        for snap, state in zip(found, states)
    ]
    return agreed, lines
