"""``check-resume --workers``: the DataLoader worker count the checker gives a run, without a change to its script.

The checker sets ``ACCELERATE_STATEFUL_NUM_WORKERS=<n>`` for a run; ``Accelerator.prepare_data_loader`` then
prepares each DataLoader as if it had been made with ``num_workers=n`` (on a copy: the user's object is left
as it was). Unset, loaders keep their own ``num_workers``. The per-rank batches do not depend on the workers
(this package's guarantee), so the checker's comparison is the same whatever the count.
"""

from __future__ import annotations

import copy
import os
from typing import Optional

from torch.utils.data import DataLoader

from ..errors import UnsupportedConfigError
from ._record_switch import WORKERS_ENV


def workers_override() -> Optional[int]:
    """The worker count the checker asked for, or ``None`` when it asked for none."""
    text = os.environ.get(WORKERS_ENV)
    if text is None or text == "":
        return None
    try:
        count = int(text)
    except ValueError:
        count = -1
    if count < 0:
        raise UnsupportedConfigError(
            f"{WORKERS_ENV}={text!r} is not a DataLoader worker count: give a whole number, 0 or more "
            f"(check-resume --workers 0,2 sets it for each run), or unset it to keep the script's own num_workers")
    return count


def with_checker_workers(data_loader: DataLoader) -> DataLoader:
    """``data_loader``, or a copy of it with the worker count the checker asked for."""
    count = workers_override()
    if count is None or count == data_loader.num_workers:
        return data_loader
    loader = copy.copy(data_loader)
    loader.num_workers = count
    if count == 0:  # settings DataLoader refuses without workers
        loader.prefetch_factor = None
        object.__setattr__(loader, "persistent_workers", False)  # DataLoader forbids setting it after __init__
        object.__setattr__(loader, "_DataLoader__multiprocessing_context", None)
    elif loader.prefetch_factor is None:
        loader.prefetch_factor = 2  # DataLoader's default with workers
    return loader
