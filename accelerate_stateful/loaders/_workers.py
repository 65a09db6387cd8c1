"""Ending a torch ``DataLoader`` iterator's worker processes at once, however the pass or the process ends.

Two rules, both about what holds a base iterator alive:

- A pass that ends by an exception leaves its base iterator referenced by the exception's traceback (the
  frames of ``_next_data`` hold it), so torch's own clean-up, which runs when the iterator is freed, waits
  as long as the user keeps the exception. The loader stops the workers itself (:func:`shut_down`).
- When the process ends (an exception out of the script, ``sys.exit``, a signal whose handler raises, the
  script's end) with an iterator still referenced (a traceback kept for printing, a module-level
  ``it = iter(dl)``, a ``Trainer`` held by a frame), torch does nothing: at interpreter exit its clean-up
  is a no-op and :mod:`multiprocessing` ends daemon workers with ``SIGTERM`` and then waits for them
  without a limit. A worker that ignores ``SIGTERM`` (a preemption handler, ``training/_preemption``: it
  must survive the launcher's signal to the whole process group) is then waited for forever, while it
  waits for work from a parent that will never send any. :func:`end_all`, run at exit before torch's and
  multiprocessing's own exit handlers, ends every worker of this package's loaders first.

- When the cyclic garbage collector frees a base iterator (its loader held in a reference cycle: an exception
  kept in a variable, a dropped object that refers to itself), the :mod:`multiprocessing` queues it sends
  work through may be finalized first, in the same collection: torch's clean-up then puts its end-of-work
  message into a queue whose feeder thread has ended, no worker receives it, and torch waits its 5 s join
  timeout for each worker before terminating it (a plain ``DataLoader`` with two persistent workers: 10 s,
  at whatever point of the program the collection ran). A finalizer registered on every base iterator with
  workers (:func:`track`) holds those queues, so they outlive the iterator, and asks the workers to stop
  through them: the collector calls it before the iterator's ``__del__``, whose clean-up then ends any
  worker still running after :data:`GRACE_S` its own way.

Either way a worker is asked to stop (torch's own ``_shutdown_workers``: the end-of-work message, the
queues closed) and, if it has not ended within :data:`GRACE_S` (a dataset call that does not return, a
worker that ignores ``SIGTERM``), killed with ``SIGKILL``.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time
import weakref
from multiprocessing.connection import wait as wait_for_sentinels
from typing import Any, Iterable

from torch.utils.data import _utils as torch_data_utils

# Below torch's own join timeout (MP_STATUS_CHECK_INTERVAL, 5 s): while a worker is alive after it, torch's
# clean-up is still joining that worker, not yet unregistering it (see _unwatch).
GRACE_S = 3.0

_running: "weakref.WeakSet[Any]" = weakref.WeakSet()  # base iterators whose workers may be alive
_finalized: "weakref.WeakSet[Any]" = weakref.WeakSet()  # base iterators with a finalizer (persistent: one)


def track(base_iterator: Any) -> None:
    """Remember ``base_iterator`` (if it has worker processes) so that :func:`end_all` reaches it, and stop its
    workers when it is freed by the garbage collector (see the module docstring)."""
    workers = getattr(base_iterator, "_workers", None)
    if not workers:
        return
    _running.add(base_iterator)
    if base_iterator not in _finalized:
        _finalized.add(base_iterator)
        finalizer = weakref.finalize(
            base_iterator, _stop_orphans, os.getpid(), list(workers),
            list(getattr(base_iterator, "_index_queues", ())), getattr(base_iterator, "_workers_done_event", None),
        )
        finalizer.atexit = False  # at exit, end_all does it


def _stop_orphans(owner: int, workers: list, index_queues: list, done_event: Any) -> None:
    """A freed base iterator's workers, stopped through queues that are still open (a no-op when they ended)."""
    if sys.is_finalizing() or os.getpid() != owner or not any(worker.is_alive() for worker in workers):
        return  # the interpreter's end (end_all ran), a copy in a forked worker, or torch's clean-up ran first
    _send_end(done_event, index_queues)
    # A worker still running after the wait (inside a dataset call) is left to torch's clean-up, which runs
    # next and ends it as it ends any worker: its pids are still registered with torch, not taken out here.
    _running_after(workers, time.monotonic() + GRACE_S)


def shut_down(base_iterator: Any, loader: Any = None) -> None:
    """Stop ``base_iterator``'s workers now (a no-op for an iterator without workers, or stopped already).

    ``loader`` is the ``DataLoader`` it came from: a loader with ``persistent_workers=True`` keeps its
    iterator for the next pass and resets it there; a stopped one cannot be reset (its queues are closed),
    so the loader forgets it and its next pass starts new workers, as a first pass does.
    """
    stop_all([base_iterator])
    if loader is not None and getattr(loader, "_iterator", None) is base_iterator:
        loader._iterator = None


def stop_all(base_iterators: Iterable[Any], grace_s: float = GRACE_S) -> None:
    """Ask every worker of ``base_iterators`` to stop, all at once; kill those still running after ``grace_s``;
    then let torch's own clean-up close the queues (its joins then find every worker ended).

    No thread is started: at interpreter exit (Python 3.12 and later) none can be.
    """
    stopping = []
    for base_iterator in base_iterators:
        workers = list(getattr(base_iterator, "_workers", ()))
        if workers and getattr(base_iterator, "_shutdown", True) is False:
            _ask(base_iterator)
            stopping.append((base_iterator, workers))
    deadline = time.monotonic() + grace_s
    for base_iterator, workers in stopping:
        late = _running_after(workers, deadline)
        if late:
            _unwatch(base_iterator)
            for worker in late:
                _kill(worker.pid)
        try:
            base_iterator._shutdown_workers()
        except RuntimeError:  # an end message that needs a queue thread at interpreter exit: every worker ended
            base_iterator._shutdown = True
        _running.discard(base_iterator)


def _ask(base_iterator: Any) -> None:
    """What torch's clean-up sends first, without its joins (:func:`_send_end`)."""
    _send_end(base_iterator._workers_done_event, getattr(base_iterator, "_index_queues", ()))


def _send_end(done_event: Any, index_queues: Iterable[Any]) -> None:
    """The end-of-work event and an end message per worker (a worker between two waits sees the event; one
    waiting for work reads the message)."""
    if done_event is not None:
        done_event.set()
    for index_queue in index_queues:
        try:
            index_queue.put(None)
        except (RuntimeError, ValueError, OSError):  # no queue thread at interpreter exit, or a closed queue
            pass


def end_all() -> None:
    """Stop the workers of every base iterator still alive (at interpreter exit, whatever references them)."""
    stop_all(list(_running))


def _running_after(workers: list, deadline: float) -> list:
    """The workers that have not ended by ``deadline`` (their sentinels: nothing is reaped here)."""
    pending = {worker.sentinel: worker for worker in workers}
    while pending and (left := deadline - time.monotonic()) > 0:
        for ended in wait_for_sentinels(list(pending), timeout=left):
            del pending[ended]
    return list(pending.values())


def _unwatch(base_iterator: Any) -> None:
    """Take the workers out of torch's SIGCHLD watch: a worker killed here must not raise in the main thread.

    torch's clean-up (still joining a live worker, ``GRACE_S`` < its join timeout) unregisters them only
    after its joins, and only while ``_worker_pids_set`` says they are registered.
    """
    if getattr(base_iterator, "_worker_pids_set", False):
        base_iterator._worker_pids_set = False
        torch_data_utils.signal_handling._remove_worker_pids(id(base_iterator))


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended meanwhile
        pass


# Registered after torch's and multiprocessing's exit handlers (imported above), so it runs before them:
# torch's clean-up still works, and multiprocessing finds no worker left to wait for.
atexit.register(end_all)
