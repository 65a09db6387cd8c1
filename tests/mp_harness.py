"""Launch side of the multi-process harness: every test that starts ``accelerate launch`` or torchrun uses it.

:func:`launch` runs one job (one launcher, or one per simulated node) in process groups of its own and returns
a :class:`Launch`: every launcher's status, the whole output in ``launch.log`` under the launch's folder, and
the error each failing rank recorded (``mp_harness_rank.fail``: its whole traceback, with the time, so the
first rank to fail is known). Nothing is launched twice.

A **watchdog** ends a job that makes no progress: once a rank has started (registered by
``mp_harness_rank.run``), no new output and no file written under the watched folders for ``stall_s`` seconds (by default 3/4 of the collective timeout, so it fires before a rank stuck in a
collective gives up on it), or still running after ``timeout_s``. Before killing, it signals every process
of the job but the launchers with ``STACK_SIGNAL``, one at a time: each rank and each of their DataLoader
workers (which inherit the rank's fault handler) writes the stack of every thread into ``stacks.log``, under a
header naming the process. Then every process of the job is killed by its id, the ranks' workers included.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

import psutil

import mp_zygote
from mp_harness_rank import COLLECTIVE_ENV, DIR_ENV, STACK_SIGNAL

ROOT = Path(__file__).resolve().parent.parent
COLLECTIVE_TIMEOUT_S = 120.0
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_", "MASTER_",
                 "TORCHELASTIC_", "ACCELERATE_")
LEFTOVER_GRACE_S = 5.0  # how long processes of a job that ended may take to exit before they are killed
# "exec": every launch starts its processes from a fresh interpreter (``make test-full``, ``make soak``).
# Otherwise a launch of ``accelerate_command``/``torchrun_command`` on one machine is forked from a
# pre-imported server (``mp_zygote``: what that changes, and what it does not).
LAUNCH_ENV = "ACCELERATE_STATEFUL_LAUNCH"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_env(**extra: str) -> dict[str, str]:
    """This environment minus any launcher's variables, plus what a CPU (gloo) launch needs, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARS)}
    env.update(ACCELERATE_USE_CPU="1", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONFAULTHANDLER="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.update(extra)
    return env


def accelerate_command(script: Path, args: Sequence[object], world: int = 2, *, port: Optional[int] = None,
                       node: Optional[tuple[int, int]] = None) -> list[str]:
    """``accelerate launch`` of ``script`` on ``world`` processes (gloo). One process is ``--cpu``: a single
    non-distributed process. ``node=(machine_rank, machines)`` makes one launcher of a job of several."""
    if world == 1:
        topology = ["--cpu", "--num_processes", "1", "--num_machines", "1"]
    else:
        topology = ["--multi_gpu", "--num_processes", str(world), "--main_process_port", str(port or free_port())]
        topology += ["--num_machines", "1"] if node is None else [
            "--num_machines", str(node[1]), "--machine_rank", str(node[0]), "--main_process_ip", "127.0.0.1"]
    return [sys.executable, "-m", "accelerate.commands.launch", *topology, "--mixed_precision", "no",
            "--dynamo_backend", "no", "--num_cpu_threads_per_process", "1", str(script), *map(str, args)]


def torchrun_command(script: Path, args: Sequence[object], world: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
            str(script), *map(str, args)]


@dataclass
class Launch:
    """What one job did. ``watchdog`` says why the watchdog ended it (``None``: it ended by itself)."""

    folder: Path
    commands: list[list[str]]
    returncodes: list[Optional[int]]
    seconds: float
    watchdog: Optional[str] = None
    leftovers: list[str] = field(default_factory=list)  # processes still running after their job ended

    @property
    def hung(self) -> bool:
        return self.watchdog is not None

    @property
    def returncode(self) -> Optional[int]:
        """The first non-zero status of the launchers, else 0 (``None`` when the watchdog ended the job)."""
        if self.hung:
            return None
        return next((code for code in self.returncodes if code != 0), 0)

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def output(self) -> str:
        return "\n".join(log.read_text(errors="replace") for log in self.logs)

    @property
    def logs(self) -> list[Path]:
        return [self.folder / f"launch{i}.log" for i in range(len(self.commands))]

    @property
    def stacks(self) -> str:
        path = self.folder / "stacks.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def errors(self) -> list[dict]:
        """The errors the ranks recorded, the first one first."""
        found = [json.loads(p.read_text()) for p in self.folder.glob("error.rank*.json")]
        return sorted(found, key=lambda e: e["time"])

    def report(self) -> str:
        """Everything there is to know about the job: the first failure whole, the stacks, the whole output."""
        status = f"watchdog: {self.watchdog}" if self.hung else f"exit status {self.returncodes}"
        lines = [f"launch in {self.folder} ended after {self.seconds:.1f} s ({status})",
                 *(f"  {' '.join(c)}" for c in self.commands)]
        errors = self.errors()
        for n, error in enumerate(errors):
            which = "first failure" if n == 0 else "then"
            lines.append(f"--- {which}: rank {error['rank']} (pid {error['pid']}), whole traceback:")
            lines.append(error["traceback"].rstrip())
        if self.leftovers:
            lines.append(f"--- processes left running after the job ended (killed): {self.leftovers}")
        if self.stacks:
            lines.append("--- stacks of every rank and worker when the watchdog fired (stacks.log):")
            lines.append(self.stacks.rstrip())
        for log in self.logs:
            lines.append(f"--- whole output ({log}):")
            lines.append(log.read_text(errors="replace").rstrip())
        return "\n".join(lines)


class Job:
    """Launchers started in sessions of their own, and every process seen below them."""

    def __init__(self, commands: Sequence[Sequence[str]], folder: Path, env: dict[str, str]) -> None:
        self.folder, self.commands = folder, [list(c) for c in commands]
        self.procs: list[subprocess.Popen] = []
        for i, command in enumerate(self.commands):
            log = folder / f"launch{i}.log"
            if len(self.commands) == 1 and forkable(command, env):
                self.procs.append(_zygote().launch(command, env, log))
                continue
            with open(log, "ab") as sink:
                self.procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=sink,
                                                   stderr=subprocess.STDOUT, start_new_session=True))
        self.launchers = [p for p in map(_process, self.procs) if p is not None]
        self.seen: dict[int, psutil.Process] = {}

    def descendants(self) -> list[psutil.Process]:
        """Every process below the launchers now, added to those seen (a worker may outlive its rank)."""
        found = []
        for launcher in self.launchers:
            try:
                found += launcher.children(recursive=True)
            except psutil.NoSuchProcess:
                pass
        for p in found:
            self.seen.setdefault(p.pid, p)
        return [p for p in self.seen.values() if _alive(p)]

    def ended(self) -> bool:
        return all(p.poll() is not None for p in self.procs)

    def dump_stacks(self) -> None:
        """Signal every process but the launchers, ranks first, each after a header naming it in stacks.log."""
        ranks = {int(p.read_text()): int(p.name.split("rank")[1]) for p in self.folder.glob("pid.rank*")}
        stacks = self.folder / "stacks.log"
        for process in sorted(self.descendants(), key=lambda p: (p.pid not in ranks, p.pid)):
            role = _role(process, ranks)
            handled = _catches(process.pid, STACK_SIGNAL)
            with open(stacks, "a") as sink:
                sink.write(f"\n=== pid {process.pid}, {role}: {_cmdline(process)}"
                           f"{'' if handled else ' (no stack handler: not signalled)'} ===\n")
            if handled:
                _signal_and_settle(process, stacks)

    def kill(self) -> None:
        """SIGKILL every process of the job by its id: launchers, ranks, workers, and any orphan seen."""
        tree = self.descendants() + [p for p in self.launchers if _alive(p)]
        for process in tree:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(tree, timeout=30)
        for proc in self.procs:
            proc.wait()

    def leftovers(self) -> list[str]:
        """Processes of the job still running after every launcher ended, given a few seconds; then killed."""
        _, alive = psutil.wait_procs(self.descendants(), timeout=LEFTOVER_GRACE_S)
        names = [f"{p.pid} {_cmdline(p)}" for p in alive if _alive(p)]
        self.kill()
        return names


def start(commands: Union[Sequence[str], Sequence[Sequence[str]]], folder: Path,
          collective_timeout_s: float = COLLECTIVE_TIMEOUT_S, **env: str) -> Job:
    """Start a job without waiting (for a test that acts on it while it runs); end it with :func:`finish`."""
    commands = [commands] if isinstance(commands[0], str) else commands
    commands = _own_port(commands)
    folder.mkdir(parents=True, exist_ok=True)
    environment = launch_env(**{DIR_ENV: str(folder), COLLECTIVE_ENV: str(collective_timeout_s)}, **env)
    return Job(commands, folder, environment)


_ports_used: set = set()  # every --main_process_port a job of this process was started with


def _own_port(commands: Sequence[Sequence[str]]) -> list[list[str]]:
    """``commands`` with a rendezvous port of this job's own, decided before it starts: a command given again
    for a later job (the same script after a kill) is given a new port, since the earlier job's may still be
    held. The launchers of one job of several machines keep sharing theirs."""
    fresh: dict = {}
    own, ports = [], set()
    for command in commands:
        command = list(command)
        for i, word in enumerate(command[:-1]):
            if word == "--main_process_port":
                if command[i + 1] in _ports_used:
                    command[i + 1] = fresh.setdefault(command[i + 1], str(free_port()))
                ports.add(command[i + 1])
        own.append(command)
    _ports_used.update(ports)
    return own


def finish(job: Job, timeout_s: float, stall_s: Optional[float] = None, watch: Sequence[Path] = (),
           started: Optional[float] = None) -> Launch:
    """Wait for ``job`` under the watchdog; whatever happens, no process of it is left running."""
    started = time.monotonic() if started is None else started
    progress, last_change, reason = None, time.monotonic(), None
    try:
        while not job.ended():
            job.descendants()
            now_progress = _progress(job, watch)
            if now_progress != progress or not any(job.folder.glob("pid.rank*")):
                progress, last_change = now_progress, time.monotonic()  # starting up is measured by timeout_s
            if stall_s is not None and time.monotonic() - last_change > stall_s:
                reason = f"no output and no file written for {stall_s:.0f} s"
            elif time.monotonic() - started > timeout_s:
                reason = f"still running after {timeout_s:.0f} s"
            if reason:
                job.dump_stacks()
                break
            time.sleep(0.5)  # the job's ranks share the cores with this loop
        leftovers = [] if reason else job.leftovers()
    finally:
        job.kill()
    codes = [p.returncode if reason is None else None for p in job.procs]
    return Launch(job.folder, job.commands, codes, round(time.monotonic() - started, 2), reason, leftovers)


def launch(commands: Union[Sequence[str], Sequence[Sequence[str]]], folder: Path, *, timeout_s: float,
           collective_timeout_s: float = COLLECTIVE_TIMEOUT_S, stall_s: Optional[float] = None,
           watch: Sequence[Path] = (), **env: str) -> Launch:
    """Run a job to its end under the watchdog (``stall_s`` defaults to 3/4 of the collective timeout)."""
    started = time.monotonic()
    job = start(commands, folder, collective_timeout_s, **env)
    stall = 0.75 * collective_timeout_s if stall_s is None else stall_s
    return finish(job, timeout_s, stall, watch, started)


def forkable(command: Sequence[str], env: dict[str, str]) -> bool:
    """Whether ``command`` is a one-machine ``accelerate launch`` or ``torchrun --standalone`` of this
    interpreter that the fork server runs as it would run (``mp_zygote``)."""
    if os.environ.get(LAUNCH_ENV) == "exec" or command[0] != sys.executable or command[1:2] != ["-m"]:
        return False
    server = launch_env()
    if env.get("PYTHONPATH") != server.get("PYTHONPATH"):
        return False  # the server imported the package from where this environment says
    read = {k for k in {*env, *server} if k.startswith(mp_zygote.READ_AT_IMPORT)}
    if any(env.get(k) != server.get(k) for k in read):
        return False  # the server's imports read these variables as they are in its own environment
    if command[2] == "accelerate.commands.launch":
        return not {"--machine_rank", "--use_deepspeed", "--use_fsdp", "--config_file"} & set(command)
    return command[2] == "torch.distributed.run" and "--standalone" in command


class Forked:
    """A launch's launcher, forked by the server: what a ``subprocess.Popen`` of the command offers here."""

    def __init__(self, conn: socket.socket, command: Sequence[str]) -> None:
        self.conn, self.args, self.returncode = conn, list(command), None
        self.pid = json.loads(self._line())["pid"]

    def _line(self) -> str:
        data = b""
        while not data.endswith(b"\n"):
            chunk = self.conn.recv(4096)
            if not chunk:
                raise RuntimeError("the launch server ended (mp_zygote); its output is in its log")
            data += chunk
        return data.decode()

    def poll(self) -> Optional[int]:
        return self._wait_s(0)

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._wait_s(0.2) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def _wait_s(self, seconds: float) -> Optional[int]:
        """The exit status once the server sent it, waiting ``seconds`` for it at most (``poll``: any fd number,
        where ``select`` stops at 1,023 and a test process may hold more)."""
        if self.returncode is None:
            waiting = select.poll()
            waiting.register(self.conn, select.POLLIN)
            if waiting.poll(seconds * 1000):
                self.returncode = json.loads(self._line())["exit"]
                self.conn.close()
        return self.returncode


class _Server:
    """The fork server of this process (started at the first forked launch, ended with this process)."""

    def __init__(self) -> None:
        folder = Path(tempfile.mkdtemp(prefix="zygote-"))
        self.path = str(folder / "socket")
        (folder / "hf_home").mkdir()
        env = launch_env(HF_HOME=str(folder / "hf_home"))
        self.log = folder / "server.log"
        with open(self.log, "ab") as sink:
            self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "mp_zygote.py"), self.path], cwd=ROOT,
                                         env=env, stdout=subprocess.PIPE, stderr=sink, start_new_session=True)
        if self.proc.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"the launch server did not start:\n{self.log.read_text(errors='replace')}")
        atexit.register(self.end)

    def end(self) -> None:
        self.proc.kill()
        self.proc.wait()  # reaped: its launches' CPU time counts in this process's children's

    def launch(self, command: Sequence[str], env: dict[str, str], log: Path) -> Forked:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        request = {"argv": list(command), "env": env, "cwd": str(ROOT), "log": str(log)}
        conn.sendall(json.dumps(request).encode() + b"\n")
        return Forked(conn, command)


_SERVER: Optional[_Server] = None


def _zygote() -> _Server:
    global _SERVER
    if _SERVER is None or _SERVER.proc.poll() is not None:
        _SERVER = _Server()
    return _SERVER


def _progress(job: Job, watch: Sequence[Path]) -> tuple:
    sizes = tuple(log.stat().st_size for log in job.folder.glob("launch*.log"))
    newest = 0.0
    for root in watch:
        for dirpath, _, files in os.walk(root):
            for name in files:
                try:
                    newest = max(newest, os.stat(os.path.join(dirpath, name)).st_mtime)
                except FileNotFoundError:
                    pass
    return sizes, newest


def _signal_and_settle(process: psutil.Process, stacks: Path) -> None:
    """Send the stack signal and wait until the process has finished writing its stacks (3 s at most)."""
    size = stacks.stat().st_size
    try:
        process.send_signal(STACK_SIGNAL)
    except psutil.NoSuchProcess:
        return
    deadline, quiet_since = time.monotonic() + 3.0, None
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = stacks.stat().st_size
        if now != size:
            size, quiet_since = now, time.monotonic()
        elif quiet_since is not None and time.monotonic() - quiet_since > 0.3:
            return


def _catches(pid: int, sig: signal.Signals) -> bool:
    """Whether ``pid`` has a handler for ``sig`` (else the signal's default action, ending it, would apply)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(caught >> (int(sig) - 1) & 1)


def _role(process: psutil.Process, ranks: dict[int, int]) -> str:
    if process.pid in ranks:
        return f"rank {ranks[process.pid]}"
    try:
        parent = process.ppid()
    except psutil.NoSuchProcess:
        return "gone"
    return f"child of rank {ranks[parent]} (a DataLoader worker)" if parent in ranks else f"child of pid {parent}"


def _cmdline(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())[:160]
    except psutil.Error:
        return "?"


def _process(proc) -> Optional[psutil.Process]:
    """The process behind ``proc``, or None where it has already ended (a forked one leaves no zombie)."""
    try:
        return psutil.Process(proc.pid)
    except psutil.NoSuchProcess:
        return None


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
