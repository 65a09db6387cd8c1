"""Rank side of the multi-process harness (``mp_harness.py`` is the launch side).

A rank script runs its ``main`` through :func:`run`::

    if __name__ == "__main__":
        mp_harness_rank.run(main)

which does three things:

- **Stacks on demand.** Python's fault handler is registered on ``STACK_SIGNAL`` (SIGUSR2), writing every
  thread's stack into the launch's ``stacks.log``. The registration and the open file are inherited by every
  process the rank forks (DataLoader workers included), so the launch side's watchdog, which signals every
  process of the launch but the launcher, gets the stack of every rank and of every worker.
- **Fail fast.** An exception that leaves ``main`` is written whole (with the rank and the time) into
  ``error.rank<R>.txt`` and to stderr, and the rank exits with status 1 at once. The launcher (torchrun,
  under ``accelerate launch``) then ends every other rank, so a rank that raised never leaves its peers in a
  collective that cannot complete. A scenario script that records results per scenario records the failing
  scenario, then lets its exception leave ``main``.

- **Imports set aside for the collector.** A ``save_state``/``load_state`` with a pass live collects garbage
  once (``checkpoint._in_step``); the objects the script's imports made (torch, accelerate, transformers) are
  frozen out of the collector's sight before ``main`` starts, as ``conftest.py`` does for the tests run in
  one process, so that a collection scans what the run creates (about 75 ms less per save and load). A pass
  dropped by the run is created after the freeze, so the collections find it as they would in any run.

The first two need the launch's folder, given by the launch side in ``MP_HARNESS_DIR``; without it (a script started by
hand) the stacks go to stderr and the traceback to stderr only.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

DIR_ENV = "MP_HARNESS_DIR"
COLLECTIVE_ENV = "MP_COLLECTIVE_TIMEOUT_S"
STACK_SIGNAL = signal.SIGUSR2
EXIT_GRACE_S = 10.0  # an exit that has not ended by then (a join in an exit handler) is cut short
_stacks_file = None  # kept open for the life of the process: the fault handler writes to its descriptor


def harness_dir() -> Optional[Path]:
    value = os.environ.get(DIR_ENV)
    return Path(value) if value else None


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def collective_timeout_s(default: float) -> float:
    """The collective timeout the launch side sized its watchdog for (``default`` when launched by hand)."""
    return float(os.environ.get(COLLECTIVE_ENV, default))


def install_stack_dump() -> None:
    """Register the fault handler on ``STACK_SIGNAL``; forked workers inherit it and write to the same file."""
    global _stacks_file
    folder = harness_dir()
    if folder is not None and _stacks_file is None:
        _stacks_file = open(folder / "stacks.log", "a", buffering=1)
        (folder / f"pid.rank{rank()}").write_text(str(os.getpid()))
    faulthandler.register(STACK_SIGNAL, file=_stacks_file or sys.stderr, all_threads=True, chain=False)


def fail(exc: BaseException) -> None:
    """Print ``exc`` whole, record it for the launch side, and end this rank now with status 1."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    folder = harness_dir()
    if folder is not None:
        record = {"rank": rank(), "pid": os.getpid(), "time": time.time(), "traceback": text}
        (folder / f"error.rank{rank()}.json").write_text(json.dumps(record))
    sys.stderr.write(f"[rank {rank()}] failed:\n{text}")
    sys.stderr.flush()
    sys.stdout.flush()
    # An exit handler or a thread join that waits on a peer which will never come must not keep this rank alive.
    threading.Thread(target=lambda: (time.sleep(EXIT_GRACE_S), os._exit(1)), daemon=True).start()
    sys.exit(1)


def set_aside() -> None:
    """Between two scenarios of one launch: collect, then set aside what survives (the process's for good, the
    modules the last scenario imported lazily among it), so that the next scenario's checkpoints, each of which
    collects garbage, scan only what that scenario makes. Every rank calls it at the same point."""
    gc.collect()
    gc.freeze()


def run(main: Callable[..., Any], *args: Any) -> None:
    """Run a rank's ``main`` with stacks on demand, ending the rank at once when it raises."""
    install_stack_dump()
    gc.collect()
    gc.freeze()
    try:
        main(*args)
    except SystemExit:  # a deliberate exit keeps its status (a preempted run's 143, say)
        raise
    except BaseException as exc:  # noqa: BLE001 - every way out of main is reported, KeyboardInterrupt too
        fail(exc)
