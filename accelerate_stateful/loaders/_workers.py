"""Stopping a torch ``DataLoader`` iterator's worker processes at once.

A pass that ends by an exception leaves its base iterator referenced by the exception's traceback
(the frames of ``_next_data`` hold it), so torch's own clean-up, which runs when the iterator is freed,
waits as long as the user keeps the exception. The loader stops the workers itself instead.
"""

from __future__ import annotations

from typing import Any


def shut_down(base_iterator: Any) -> None:
    """Stop ``base_iterator``'s workers now (a no-op for an iterator without workers, or stopped already)."""
    stop = getattr(base_iterator, "_shutdown_workers", None)
    if callable(stop):
        stop()
