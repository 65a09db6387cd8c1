"""DataLoaders whose position this package cannot record, but Accelerate can run: left to Accelerate.

A map-style loader that hands out one sample at a time (``batch_size=None``) or draws from a sampler
without ``len()`` has no position the shard loader can express (a count of samples in an epoch of known
length). Plain Accelerate runs both: a user switching to this package expects the script to run as
before. So such a loader is prepared by Accelerate's own ``prepare_data_loader``, with a warning saying
that its position is not recorded by this package; only what Accelerate keeps for it is saved. Under the
dispatcher (``dispatch_batches=True``) too for a sampler without ``len()``, which Accelerate's dispatcher
runs; ``batch_size=None`` there is refused by the dispatcher with the fix.

A loader with ``batch_size=None`` on more than one process is refused instead: Accelerate's loader
cannot shard it either (its first batch fails with ``TypeError: 'NoneType' object is not iterable``),
and the refusal says the fix.
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Any

from torch.utils.data import IterableDataset

from .. import _log
from .batchsampler import uses_batch_sampler
from .._context import DistContext
from ..errors import UnsupportedConfigError

logger = _log.get_logger(__name__)


def leave_to_accelerate(data_loader: Any, ctx: DistContext, dispatch: bool = False) -> bool:
    """Whether ``data_loader`` is prepared by Accelerate itself; warns once per loader when it is.

    Raises:
        UnsupportedConfigError: ``batch_size=None`` on more than one process.
    """
    if isinstance(data_loader.dataset, IterableDataset) or uses_batch_sampler(data_loader):
        return False
    if data_loader.batch_size is None:
        if dispatch:
            return False
        if ctx.world_size > 1:
            raise UnsupportedConfigError(
                f"the DataLoader has batch_size=None (one sample at a time), which cannot be sharded over "
                f"{ctx.world_size} processes (Accelerate's own loader fails at its first batch too); pass "
                "batch_size=..., or batch_sampler=... for batches of your own"
            )
        why, fix = "it has batch_size=None: one sample at a time", "pass batch_size=<n>"
    elif not isinstance(data_loader.sampler, Sized):
        name = type(data_loader.sampler).__name__
        why, fix = f"its sampler {name} has no len()", f"give {name} a __len__"
    else:
        return False
    if ctx.is_main:
        logger.warning(
            "this package does not record the position of this DataLoader (%s), so Accelerate prepares "
            "it, as without this package: save_state(), load_state() and resume() keep for it only what "
            "Accelerate keeps (with use_stateful_dataloader=True, torchdata's state in dl_state_dict*.bin), "
            "without this package's checks, its exact resume or a resume on another number of processes. "
            "To have its position recorded, %s.",
            why, fix,
        )
    return True
