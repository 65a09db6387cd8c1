"""Every way a process ends ends its data-loading workers within seconds, whatever still references them.

Two real ranks on gloo, started without a launcher (as if it had been killed with them): rank 0 SIGKILLs
itself at a point drawn from a seeded random generator (a step, and there: with the batch in hand, after
the optimizer step, or inside a checkpoint's save); rank 1 must fail and end, it and every worker it
started, within ``BOUND_S`` of rank 0's death. A ``StatefulTrainer`` and a hand-written loop with
``checkpoint_on_preemption`` (both make their workers ignore SIGTERM), with 0 and 2 workers. ``BOUND_S``
is a hang bound, not a speed requirement: before the fix rank 1 waited for its workers forever.

One process: a script that ends with iterators still live (module level, with workers that ignore
SIGTERM), by its end, an exception, ``sys.exit`` or Ctrl-C, ends at once and prints nothing of its own.

Processes are read from ``/proc``; a process counts as gone once it has exited (a zombie is gone).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).with_name("endings.py")
BOUND_S = 30.0
START_S = 240.0  # for the ranks to reach the kill point on a loaded machine
SEED = 17


def _stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, parent, start time)`` of a process, ``None`` once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[19])


def _alive(process: tuple[int, int]) -> bool:
    stat = _stat(process[0])
    return stat is not None and stat[2] == process[1] and stat[0] not in ("Z", "X")


def _descendants(roots: set[int]) -> set[tuple[int, int]]:
    """Every live process below ``roots``, as ``(pid, start time)`` (a pid reused later is another process)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None and stat[0] != "Z":
            children.setdefault(stat[1], []).append(int(entry.name))
            starts[int(entry.name)] = stat[2]
    found, frontier = set(), list(roots)
    while frontier:
        for child in children.get(frontier.pop(), []):
            found.add((child, starts[child]))
            frontier.append(child)
    return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Job:
    """Two ranks of ``endings.py``; what each started is recorded while it runs."""

    def __init__(self, out: Path, loop: str, workers: int, step: int, at: str) -> None:
        out.mkdir(parents=True)
        self.out, self.name = out, f"{loop}, {workers} workers, rank 0 killed at step {step} ({at})"
        port = str(_free_port())
        self.ranks = []
        for rank in (0, 1):
            env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1",
                       PYTHONUNBUFFERED="1")
            with open(out / f"rank{rank}.out", "wb") as sink:
                self.ranks.append(subprocess.Popen(
                    [sys.executable, str(SCRIPT), str(out), loop, str(workers), str(step), at], cwd=ROOT, env=env,
                    stdout=sink, stderr=subprocess.STDOUT, start_new_session=True))
        self.seen: set[tuple[int, int]] = set()
        self.killed_at: float | None = None
        self.ended_at: float | None = None

    def watch(self) -> None:
        live = {rank.pid for rank in self.ranks if rank.poll() is None}
        self.seen |= _descendants(live)
        if self.killed_at is None and self.ranks[0].poll() is not None:
            self.killed_at = time.monotonic()
        if self.ended_at is None and self.ranks[1].poll() is not None and not self.left():
            self.ended_at = time.monotonic()

    def left(self) -> list[int]:
        """What is still running: rank 1, and any process either rank started."""
        running = [pid for pid, start in self.seen if _alive((pid, start))]
        return running + [rank.pid for rank in self.ranks if rank.poll() is None]

    def done(self, now: float) -> bool:
        return self.ended_at is not None or (self.killed_at is not None and now - self.killed_at > BOUND_S)

    def kill(self) -> None:
        for pid in self.left():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for rank in self.ranks:
            rank.wait()

    def log(self, rank: int) -> str:
        return (self.out / f"rank{rank}.out").read_text(errors="replace")


def _kill_points(count: int) -> list:
    """``count`` jobs: the loops and worker counts in turn, each at a seeded random step and point."""
    draw = random.Random(SEED)
    cells = [("trainer", 2), ("hand", 2), ("trainer", 0), ("hand", 0)]
    return [(*cells[i % len(cells)], draw.randint(1, 12), draw.choice(["batch", "step", "save"]))
            for i in range(count)]


def _run_jobs(tmp_path: Path, points: list, at_once: int) -> list[Job]:
    finished, waiting, running = [], list(points), []
    deadline = time.monotonic() + START_S
    try:
        while waiting or running:
            while waiting and len(running) < at_once:
                loop, workers, step, at = waiting.pop(0)
                running.append(Job(tmp_path / f"job{len(finished) + len(running)}", loop, workers, step, at))
            time.sleep(0.05)
            now = time.monotonic()
            for job in list(running):
                job.watch()
                if job.done(now) or now > deadline:
                    running.remove(job)
                    finished.append(job)
                    job.left_at_end = job.left()
                    job.kill()
    finally:
        for job in running:
            job.kill()
    return finished


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_rank_whose_peer_was_killed_fails_and_ends_with_all_its_workers(tmp_path):
    jobs = _run_jobs(tmp_path, _kill_points(4), at_once=2)  # each loop and worker count once
    problems = []
    for job in jobs:
        if job.killed_at is None:
            problems.append(f"{job.name}: rank 0 never reached its kill point:\n{job.log(0)[-2000:]}")
            continue
        if job.ended_at is None:
            problems.append(f"{job.name}: {len(job.left_at_end)} processes still running {BOUND_S:.0f} s after "
                            f"rank 0 died (rank 1 and its workers):\n{job.log(1)[-2000:]}")
            continue
        code = job.ranks[1].returncode
        if code <= 0:
            problems.append(f"{job.name}: rank 1 ended with status {code}, not with an error:\n{job.log(1)[-2000:]}")
        print(f"{job.name}: rank 1 and every worker gone {job.ended_at - job.killed_at:.1f} s after rank 0 died, "
              f"status {code}; {len(job.seen)} processes started by the ranks")
    assert not problems, "\n\n".join(problems)


# --------------------------------------------------------------------------- one process, its end
ENDING = textwrap.dedent("""
    import os, signal, sys, time
    import torch
    from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
    from accelerate_stateful import Accelerator

    class Slow(Dataset):  # after the first batch, a worker never returns
        def __len__(self):
            return 200

        def __getitem__(self, i):
            if i >= 4:
                time.sleep(3600)
            return i

    class Stream(IterableDataset):  # read by this package's stream loader: its workers talk over channels
        def __iter__(self):
            info = get_worker_info()
            yield from range(info.id, 400, info.num_workers)

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
                              project_config=ProjectConfiguration(project_dir=sys.argv[2],
                                                                  automatic_checkpoint_naming=True))
    loaders = [accelerator.prepare(DataLoader(data, batch_size=4, num_workers=2, persistent_workers=persistent))
               for data in (list(range(40)), Slow(), Stream()) for persistent in (False, True)]
    accelerator.prepare(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1))  # the step that decides
    accelerator.checkpoint_on_preemption()  # the workers ignore SIGTERM
    iterators = [iter(dl) for dl in loaders]
    for it in iterators:
        next(it)
    kept = None
    try:
        raise RuntimeError("a kept exception: its frames hold the iterators")
    except RuntimeError as exc:
        kept = exc
    print("ready", flush=True)
    how = sys.argv[1]
    if how == "exception":
        raise ValueError("the script failed")
    if how == "exit":
        sys.exit(3)
    if how == "interrupt":
        # SIGINT as a shell leaves it: a test runner's worker process may hold it ignored or blocked, and a
        # child inherits both across exec (Python then installs no KeyboardInterrupt handler): in CI's
        # two-worker runs the script then slept to its end with status 0, twice.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.kill(os.getpid(), signal.SIGINT)  # process-directed, as Ctrl-C is
        for _ in range(600):  # bytecode runs, as in a training loop: the main thread raises at once
            time.sleep(0.1)
""")


@pytest.mark.timeout(240)
def test_a_script_that_ends_with_live_iterators_ends_with_its_workers_and_says_nothing(tmp_path):
    script = tmp_path / "ending.py"
    script.write_text(ENDING)
    # Python ends itself with SIGINT after an uncaught KeyboardInterrupt (status -2).
    expected = {"end": (0, ""), "exception": (1, "ValueError: the script failed"), "exit": (3, ""),
                "interrupt": (-signal.SIGINT, "KeyboardInterrupt")}
    runs = {how: subprocess.Popen([sys.executable, str(script), how, str(tmp_path / how)], cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
            for how in expected}
    seen = {how: set() for how in expected}
    started = time.monotonic()
    try:
        while any(run.poll() is None for run in runs.values()) and time.monotonic() - started < 180:
            for how, run in runs.items():
                seen[how] |= _descendants({run.pid}) if run.poll() is None else set()
            time.sleep(0.05)
    finally:
        hung = [how for how, run in runs.items() if run.poll() is None]
        for how in hung:
            os.killpg(runs[how].pid, signal.SIGKILL)  # the script and its workers (a session of their own)
    assert hung == [], f"still running {time.monotonic() - started:.0f} s after the start: {hung}"
    for how, run in runs.items():
        out, err = run.communicate()
        code, says = expected[how]
        assert out == "ready\n" and run.returncode == code, f"{how}: status {run.returncode}\n{err}"
        if says:  # the script's own traceback, and nothing else
            assert err.startswith("Traceback") and err.count("Traceback") == 1 and \
                err.rstrip().endswith(says), f"{how}: {err}"
        else:
            assert err == "", f"{how}: {err}"
        assert [pid for pid, start in seen[how] if _alive((pid, start))] == [], f"{how}: workers outlived it"
