"""The dispatcher's one broadcast per step: the main process's global batch, its epoch's end, or its reader's error.

Every rank but the main process waits in this broadcast for each step; whatever the main process's reader
ends the step with (a batch, the end, an exception) reaches every rank through it, so a reader's error is
raised on every rank at the same step instead of leaving the others waiting until the collective times out.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .._context import DistContext
from ..checkpoint._checkpoints import _verdict, rebuild


def broadcast_step(found: Optional[tuple[list, Any]], failure: Optional[Exception], ctx: DistContext,
                   device: Optional[torch.device]) -> Any:
    """Send the main process's global batch (or the end of the epoch) to every rank.

    An error of the reader travels the same way, in place of the batch: the main process raises it, and every
    other rank raises it too (same class where every rank can build it, same message), instead of waiting for a
    batch that will never come.
    """
    from accelerate.utils import broadcast, get_data_structure, initialize_tensors, send_to_device

    if failure is not None:
        info = {_FAILED: _verdict(failure)}
    else:
        info = None if found is None else get_data_structure(found[1])
    info = ctx.broadcast(info)
    if isinstance(info, dict) and _FAILED in info:
        if failure is not None:
            raise failure
        raise _rebuilt(info[_FAILED])
    if info is None:
        return None
    if ctx.is_main:
        tokens, batch = found
    else:
        tokens, batch = [], initialize_tensors(info)
    if device is not None:
        batch = send_to_device(batch, device)
    return tokens, broadcast(batch, from_process=0)


_FAILED = "accelerate_stateful: the reader failed"  # a key no batch structure holds


def _rebuilt(verdict: dict) -> Exception:
    """The reader's error, raised on a rank that did not read (named where its class cannot be built here)."""
    return rebuild(verdict, lambda kind: ("" if verdict["name"] == kind.__name__
                                          else f"{verdict['name']} on the main process: ") + verdict["message"])
