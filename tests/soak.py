"""Many short 2-process launches in a row: does every one of them end?

Each launch runs ``mp_soak.py`` on 2 real processes (gloo): every kind of loader with data-loading
workers, a checkpoint, one loader abandoned mid-epoch, ``accelerator.end_training()``. A launch that has not exited ``hang_s`` seconds
after its start counts as a hang: its ranks get SIGABRT first, so that Python's fault handler
(``PYTHONFAULTHANDLER=1``) prints every thread's stack into the log, then the whole job is killed.
A launch whose output holds "terminate called" (a C++ thread still running when the process ended)
is counted too. ``make soak`` runs 100 launches; the test suite runs a few.

    python tests/soak.py --launches 100 --out soak_out
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
TERMINATE = "terminate called"


@dataclass
class Launch:
    index: int
    seconds: float
    returncode: int | None  # None: it hung and was killed
    terminate_message: bool
    work_done: bool  # both ranks got to the end of the script
    log: str

    @property
    def hung(self) -> bool:
        return self.returncode is None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_env() -> dict[str, str]:
    launcher_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_", "ACCELERATE_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher_vars)}
    env.update(ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    return env


def command(script: Path, script_args: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--num_cpu_threads_per_process", "1", "--main_process_port", str(free_port()),
        str(script), *script_args,
    ]


def launch_once(index: int, out: Path, hang_s: float, script: Path | None = None,
                script_args: list[str] | None = None) -> Launch:
    """One launch; a hang is dumped (SIGABRT to the ranks) and killed, never waited on past ``hang_s``."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "launch.log"
    script = script or ROOT / "tests" / "mp_soak.py"
    script_args = [str(out)] if script_args is None else script_args
    started = time.monotonic()
    with open(log, "wb") as sink:
        proc = subprocess.Popen(command(script, script_args), cwd=ROOT, env=launch_env(), stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        returncode = proc.wait(timeout=hang_s)
    except subprocess.TimeoutExpired:
        returncode = None
        _dump_and_kill(proc)
    seconds = time.monotonic() - started
    text = log.read_text(errors="replace")
    done = all((out / f"done_rank{rank}").exists() for rank in range(2))
    return Launch(index, round(seconds, 2), returncode, TERMINATE in text, done, str(log))


def _dump_and_kill(proc: subprocess.Popen) -> None:
    """SIGABRT every rank (the fault handler prints each thread's stack), then SIGKILL the whole job."""
    tree = [psutil.Process(proc.pid)]
    tree += tree[0].children(recursive=True)
    for p in tree[1:]:
        try:
            if "python" in p.name().lower():
                p.send_signal(signal.SIGABRT)
        except psutil.NoSuchProcess:
            pass
    time.sleep(2)
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()


def soak(launches: int, out: Path, hang_s: float, budget_s: float | None = None) -> list[Launch]:
    """Run up to ``launches`` launches (fewer if ``budget_s`` runs out); every one is bounded by ``hang_s``."""
    results: list[Launch] = []
    started = time.monotonic()
    for index in range(launches):
        if budget_s is not None and results and time.monotonic() - started + hang_s > budget_s:
            break
        result = launch_once(index, out / f"launch_{index:03d}", hang_s)
        results.append(result)
        print(json.dumps(asdict(result)), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launches", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path("soak_out"))
    parser.add_argument("--hang-s", type=float, default=120.0, help="a launch still running after this hangs")
    args = parser.parse_args()
    results = soak(args.launches, args.out, args.hang_s)
    hung = [r.index for r in results if r.hung]
    terminate = [r.index for r in results if r.terminate_message]
    failed = [r.index for r in results if not r.hung and r.returncode != 0]
    times = sorted(r.seconds for r in results if not r.hung)
    median = times[len(times) // 2] if times else float("nan")
    print(f"{len(results)} launches: {len(hung)} hung {hung}, {len(terminate)} printed '{TERMINATE}' {terminate}, "
          f"{len(failed)} failed {failed}; median {median:.1f} s, slowest {max(times, default=0):.1f} s")
    sys.exit(1 if hung or terminate or failed else 0)


if __name__ == "__main__":
    main()
