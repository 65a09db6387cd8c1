"""A user's ``worker_init_fn`` sees the user's dataset, whatever wrapper the base loader iterates.

The rule, for every loader of this package: inside a worker,
``torch.utils.data.get_worker_info().dataset`` is the user's dataset (the
worker's copy of it), and the user's ``worker_init_fn`` is called once per
worker with the worker's id, as torch does. That is what the sharding recipe of
torch's ``IterableDataset`` documentation relies on (``worker_info.dataset.start
= ...`` in a ``worker_init_fn``).

A stream loader's workers play *logical* workers (see ``_stream``): a resumed
pass may hand physical worker ``j`` the share of logical worker ``j +
rotation``. The user's ``worker_init_fn`` therefore runs when the worker learns
which logical worker it plays, with that id, so a dataset configured by it
reads the share that worker's position belongs to. A persistent worker asked to
play another logical worker in a later pass gets its dataset copy back as it
was before the first call (kept by deep copy) and the function is called again
with the new id.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Optional

from ..errors import UnsupportedConfigError

_played: Optional[int] = None  # the logical worker this process's worker_init_fn last ran for
_pristine: Optional[dict] = None  # the user's dataset copy as it was before that first call


def show_dataset(dataset: Any, **fields: Any) -> None:
    """Make ``get_worker_info()`` in this worker report ``dataset`` (and ``fields``, such as ``id``)."""
    from torch.utils.data._utils import worker as torch_worker

    info = torch_worker._worker_info
    fields = {"dataset": dataset, **fields}
    if dataclasses.is_dataclass(info):
        torch_worker._worker_info = dataclasses.replace(info, **fields)
    else:
        values = {"id": info.id, "num_workers": info.num_workers, "seed": info.seed, **fields}
        torch_worker._worker_info = type(info)(**values)


class LogicalWorkerInit:
    """Runs the user's ``worker_init_fn`` in a stream worker, as the logical worker it plays."""

    def __init__(self, fn: Callable[[int], Any], persistent: bool) -> None:
        self.fn, self.persistent = fn, persistent

    def play(self, logical: int, dataset: Any) -> None:
        global _played, _pristine
        if _played == logical:
            return
        if _played is None:
            if self.persistent:
                _pristine = copy.deepcopy(vars(dataset)) if hasattr(dataset, "__dict__") else None
        elif _pristine is None:
            raise UnsupportedConfigError(
                f"a persistent worker configured by worker_init_fn as worker {_played} must now read the share of "
                f"worker {logical}, but {type(dataset).__name__} cannot be copied back to its state before "
                "worker_init_fn ran; pass persistent_workers=False"
            )
        else:
            vars(dataset).clear()
            vars(dataset).update(copy.deepcopy(_pristine))
        self.fn(logical)
        _played = logical


class ShowingWorkerInit:
    """A base loader's ``worker_init_fn``: show the user's dataset, then call the user's function."""

    def __init__(self, fn: Callable[[int], Any], dataset: Any) -> None:
        self.fn, self.dataset = fn, dataset

    def __call__(self, worker_id: int) -> None:
        show_dataset(self.dataset)
        self.fn(worker_id)
