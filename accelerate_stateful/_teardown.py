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
"""

from __future__ import annotations

import atexit
import os
import time
from pathlib import Path

GLOO_THREAD = "pt_gloo_runloop"
QUIET_S = 0.03  # a thread waiting for the GIL is woken every 5 ms (the interpreter's switch interval)
LIMIT_S = 5.0


def _gloo_threads() -> list[Path]:
    tasks = Path(f"/proc/{os.getpid()}/task")
    found = []
    for task in tasks.iterdir() if tasks.is_dir() else ():
        try:
            if (task / "comm").read_text().strip() == GLOO_THREAD:
                found.append(task)
        except OSError:  # the thread ended while being listed
            continue
    return found


def _switches(threads: list[Path]) -> tuple:
    counts = []
    for task in threads:
        try:
            status = (task / "status").read_text()
        except OSError:
            counts.append(None)  # ended: as still as it gets
            continue
        counts.append(tuple(line for line in status.splitlines() if "ctxt_switches" in line))
    return tuple(counts)


def settle(limit_s: float = LIMIT_S) -> bool:
    """Release the GIL until every gloo worker thread of this process is idle (at most ``limit_s``).

    Returns whether they were idle (``True`` also where there are none, or no ``/proc`` to look in).
    """
    threads = _gloo_threads()
    if not threads:
        return True
    deadline = time.monotonic() + limit_s
    last, still_since = _switches(threads), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.005)
        now = _switches(threads)
        if now != last:
            last, still_since = now, time.monotonic()
        elif time.monotonic() - still_since >= QUIET_S:
            return True
    return False


# At exit too: a script that never calls end_training() destroys its process group while the interpreter
# finalizes, the case that aborts with "terminate called".
atexit.register(settle)
