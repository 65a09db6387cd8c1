"""Whether this interpreter can start a DataLoader worker by ``fork`` safely in a distributed run.

CPython bug gh-112275 (fixed in 3.12.0 and backported to 3.11.10, 3.10.15, 3.9.20 and 3.8.20): a
forked child reinitialises the runtime's thread-state lock only *after* it has taken that lock to delete
the parent's other thread states. A native thread that attaches to the interpreter (``PyGILState_Ensure``
from a thread without a thread state creates one, under that lock and without the GIL) at the instant of
the fork leaves the lock taken in the child, which then waits forever inside ``os.fork()``, before its
first line of Python; a torn list of thread states makes it die of ``SIGSEGV`` instead. A process group's
worker threads attach that way whenever they free a tensor Python owned, so in a distributed run every
pass that forks its workers (each epoch, without ``persistent_workers``) draws the lot again.

Measured (``docs/reliability.md``): a native thread attaching in a loop while the main thread forks left
152 of 709 children hung on Python 3.11.7, none of 2,506 on 3.12.1 and none of 1,971 on 3.13.0; two
scenario launches in three runs of the suite on 3.11.7 lost a worker that way.
"""

from __future__ import annotations

import multiprocessing
import sys
from typing import Any

from .. import _log

logger = _log.get_logger(__name__)

# The first patch release of each affected minor version that carries the fix; 3.12 and later never had it.
FIXED_IN = {(3, 8): 20, (3, 9): 20, (3, 10): 15, (3, 11): 10}

_warned = False


def fork_is_safe(version: tuple = tuple(sys.version_info[:3])) -> bool:
    """Whether ``version`` (major, minor, micro) of CPython is free of gh-112275."""
    major, minor, micro = version[:3]
    if (major, minor) >= (3, 12):
        return True
    fixed = FIXED_IN.get((major, minor))
    return fixed is not None and micro >= fixed


def start_method(base_loader: Any) -> str:
    """How ``base_loader`` starts its workers: its own ``multiprocessing_context``, else the default."""
    context = getattr(base_loader, "multiprocessing_context", None)
    if context is None:
        context = multiprocessing.get_context()
    elif isinstance(context, str):
        return context
    return context.get_start_method()


def warn_if_unsafe(base_loader: Any, world_size: int, version: tuple = tuple(sys.version_info[:3])) -> bool:
    """Warn once per process when ``base_loader`` will fork workers in a distributed run on an affected
    interpreter; returns whether this loader is in that case (the same on every rank: one interpreter)."""
    global _warned
    if world_size < 2 or getattr(base_loader, "num_workers", 0) == 0 or fork_is_safe(version):
        return False
    if start_method(base_loader) != "fork":
        return False
    if not _warned:
        _warned = True
        logger.warning(
            "Python %s can hang or kill a DataLoader worker at its start when it forks while a process group's "
            "thread attaches to the interpreter (CPython bug gh-112275): a rank then waits for that worker until "
            "its collective times out. Use Python 3.12 or later (or 3.11.10 / 3.10.15 / 3.9.20 or later), or pass "
            "multiprocessing_context='forkserver' to the DataLoader (its dataset must then pickle).",
            ".".join(map(str, version[:3])),
        )
    return True
