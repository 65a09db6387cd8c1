"""Stopping a torch ``DataLoader`` iterator's worker processes at once.

A pass that ends by an exception leaves its base iterator referenced by the exception's traceback
(the frames of ``_next_data`` hold it), so torch's own clean-up, which runs when the iterator is freed,
waits as long as the user keeps the exception. The loader stops the workers itself instead.

A loader with ``persistent_workers=True`` keeps its iterator (``DataLoader._iterator``) and resets it at
the next ``iter()``; a stopped one cannot be reset (its queues are closed), so the loader forgets it and
the next pass starts new workers, as a loader's first pass does.
"""

from __future__ import annotations

from typing import Any


def shut_down(base_iterator: Any, loader: Any = None) -> None:
    """Stop ``base_iterator``'s workers now (a no-op for an iterator without workers, or stopped already).

    ``loader`` is the ``DataLoader`` it came from: if it keeps the iterator for its next pass, it drops it.
    """
    stop = getattr(base_iterator, "_shutdown_workers", None)
    if callable(stop):
        stop()
    if loader is not None and getattr(loader, "_iterator", None) is base_iterator:
        loader._iterator = None
