"""The processes of a run ``check-resume`` started, and their end.

A launcher's ranks may run in sessions of their own: torchrun (and so ``accelerate launch --multi_gpu``) starts
each rank with ``start_new_session``, and a rank's DataLoader workers join its group. Signalling the launcher's
group alone leaves the ranks training; they go on writing records and checkpoints while the next run starts.
A :class:`Job` therefore keeps every process group below the launcher it has seen, and signals them all; its
end waits until none of their processes is left. On a system without ``/proc`` only the launcher's group is
known.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

END_TIMEOUT_S = 30.0


def _stats() -> list[tuple[int, int, int]]:
    """``(pid, parent pid, process group)`` of every process, from ``/proc`` (empty where there is none)."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # ended meanwhile
        fields = stat[stat.rindex(b")") + 2:].split()
        if fields[0] not in (b"Z", b"X"):
            found.append((int(name), int(fields[1]), int(fields[2])))
    return found


class Job:
    """The launcher ``proc`` (started in a session of its own) and the process groups below it."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.groups = {proc.pid}

    def look(self) -> None:
        """Add the groups of the launcher's descendants now (a rank's group, with its workers)."""
        stats = _stats()
        children: dict[int, list[tuple[int, int]]] = {}
        for pid, parent, group in stats:
            children.setdefault(parent, []).append((pid, group))
        todo = [self.proc.pid]
        while todo:
            for pid, group in children.get(todo.pop(), []):
                self.groups.add(group)
                todo.append(pid)

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to every group of the job."""
        self.look()
        for group in self.groups:
            try:
                os.killpg(group, sig)
            except (ProcessLookupError, PermissionError):
                pass  # that group has ended

    def end(self) -> None:
        """Kill every process of the job and wait until none is left (at most ``END_TIMEOUT_S``)."""
        self.signal(signal.SIGKILL)
        self.proc.wait()
        deadline = time.monotonic() + END_TIMEOUT_S
        while any(group in self.groups for _, _, group in _stats()) and time.monotonic() < deadline:
            self.signal(signal.SIGKILL)
            time.sleep(0.05)
