"""Ending a process cleanly: the gloo process group's worker threads must be idle before it is destroyed.

Found with the soak (``tests/soak.py``) and gdb: a gloo ``ProcessGroup`` runs its collectives on
worker threads (``pt_gloo_runloop``). After a collective completes, the worker thread destroys the
finished work, and with it the tensors it held; a tensor with a Python object needs the GIL to be
released. When the process group itself is destroyed (by ``destroy_process_group()`` in
``end_training()``, or later when the last DDP model referring to it is freed, or at interpreter exit),
its destructor joins those threads while the destroying thread holds the GIL:

- if a worker thread is still waiting for the GIL to free the tensors of the last collective, neither
  thread can go on: the rank has finished its work and never exits;
- if that happens while the interpreter finalizes, the worker thread is ended by the interpreter in the
  middle of a C++ destructor, and the process aborts with "terminate called without an active exception".

Both depend on timing (the last collective a few milliseconds before the end), which is why they were
seen in about 1 launch in 50 to 150. The rule: before the process group can be destroyed, release the GIL
until every gloo worker thread is idle. An idle worker waits on a condition without a timeout and is never
woken; one waiting for the GIL is woken every few milliseconds (its context-switch count grows). So
:func:`settle` sleeps (which releases the GIL) until those counts stay still.

Which threads: gloo's workers name themselves ``pt_gloo_runloop`` in the torch releases that name them. Older
ones (torch 2.6) leave them unnamed. There (a process that has had a process group and never saw a thread of
that name) every other thread of the process is watched by its voluntary switches: a thread waiting for the
GIL makes one every 5 ms, a thread spinning on a CPU (as an OpenMP pool does for a while) or blocked for good
makes none. Threads the kernel shows waiting in an event loop are left out (gloo's transport loop wakes every
10 ms).
Before the name was read only, and at the dependency floor the rule did nothing: 4 in 14 three-process
launches of ``tests/test_lifecycle_mp.py`` hung there in ``destroy_process_group``.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from pathlib import Path

GLOO_THREAD = "pt_gloo_runloop"
QUIET_S = 0.03  # a thread waiting for the GIL is woken every 5 ms (the interpreter's switch interval)
LIMIT_S = 5.0
# The lines of /proc/<pid>/task/<tid>/status counted.
ALL_SWITCHES, VOLUNTARY = ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"), ("voluntary_ctxt_switches",)
_had_group = False  # whether this process has had a torch.distributed process group
_named_seen = False  # whether this process has seen a gloo thread by its name (this torch release names them)


def _tasks() -> list[Path]:
    tasks = Path(f"/proc/{os.getpid()}/task")
    return list(tasks.iterdir()) if tasks.is_dir() else []


def _gloo_threads() -> list[Path]:
    found = []
    for task in _tasks():
        try:
            if (task / "comm").read_text().strip() == GLOO_THREAD:
                found.append(task)
        except OSError:  # the thread ended while being listed
            continue
    return found


def _other_threads() -> list[Path]:
    """Every thread of this process but the calling one and those waiting in an event loop (gloo's transport
    loop polls every 10 ms in the releases that do not name it; it never takes the GIL)."""
    own = str(threading.get_native_id())
    return [task for task in _tasks() if task.name != own and not _in_event_loop(task)]


def _in_event_loop(task: Path) -> bool:
    try:
        return "epoll" in (task / "wchan").read_text()  # where the kernel has it waiting ("0" where not shown)
    except OSError:
        return False


def _has_had_group() -> bool:
    global _had_group
    dist = sys.modules.get("torch.distributed")
    if not _had_group and dist is not None and dist.is_available() and dist.is_initialized():
        _had_group = True
    return _had_group


def _watched() -> tuple[list[Path], tuple[str, ...]]:
    """The threads :func:`settle` waits on, and which of their context switches it counts (module docstring)."""
    global _named_seen
    had_group, named = _has_had_group(), _gloo_threads()
    _named_seen = _named_seen or bool(named)
    if named or not had_group or _named_seen:  # this torch names them: none named, none running
        return named, ALL_SWITCHES
    return _other_threads(), VOLUNTARY


def _switches(threads: list[Path], counted: tuple[str, ...]) -> tuple:
    counts = []
    for task in threads:
        try:
            status = (task / "status").read_text()
        except OSError:
            counts.append(None)  # ended: as still as it gets
            continue
        counts.append(tuple(line for line in status.splitlines() if line.startswith(counted)))
    return tuple(counts)


def settle(limit_s: float = LIMIT_S) -> bool:
    """Release the GIL until every gloo worker thread of this process is idle (at most ``limit_s``).

    Returns whether they were idle (``True`` also where there are none, or no ``/proc`` to look in).
    """
    return wait_still(*_watched(), limit_s=limit_s)


def wait_still(threads: list[Path], counted: tuple[str, ...], limit_s: float = LIMIT_S) -> bool:
    """Sleep until ``threads``' ``counted`` context switches stay still for ``QUIET_S`` (at most ``limit_s``)."""
    if not threads:
        return True
    deadline = time.monotonic() + limit_s
    last, still_since = _switches(threads, counted), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.005)
        now = _switches(threads, counted)
        if now != last:
            last, still_since = now, time.monotonic()
        elif time.monotonic() - still_since >= QUIET_S:
            return True
    return False


# At exit too: a script that never calls end_training() destroys its process group while the interpreter
# finalizes, the case that aborts with "terminate called".
atexit.register(settle)
