"""Kill a 2-process training run mid-epoch, restart it on 2 and on 3 processes, and prove nothing is lost.

``make demo`` runs ``examples/train.py`` under ``accelerate launch`` (CPU
processes on gloo):

1. ``demo_runs/reference``: two processes, uninterrupted, start to finish.
2. ``demo_runs/interrupted``: killed with SIGKILL mid-epoch (every process of
   the job, data-loading workers included), then started again with the very
   same command, which resumes from the newest complete checkpoint; by default
   it is killed twice, in epochs 1 and 2. ``_verify`` requires every rank to
   train exactly the reference's batches (see its docstring).
3. ``demo_runs/elastic``: a copy of the interrupted run as the first kill left
   it, resumed by the same command on 3 processes (and 1 worker each instead
   of 2), to the end. ``_elastic`` requires the rest of the interrupted epoch
   to be delivered exactly once across the new ranks, later epochs to be a
   fresh 3-process run's, and every rank's batches to equal an in-process
   simulation of the chain (see its docstring).

``--self-check`` then damages copies of the streams and requires both
verifiers to reject each one. The exit status is non-zero on any failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, NamedTuple, Optional

import psutil

# The demo's modules sit next to it: importable whether this file runs as a script or is loaded by its path.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _elastic  # noqa: E402
import _verify  # noqa: E402
import train  # noqa: E402
from _verify import DemoError, Verdict, is_json, print_verdict, verify  # noqa: E402
from accelerate_stateful import latest_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "train.py"
# What the demo writes under --out besides its *.log files; anything else there is not the demo's to delete.
OUTPUTS = ("reference", "interrupted", "elastic", "self_check")
# Launcher settings that would otherwise leak in from the caller's shell and change the job.
LEAKY_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# --------------------------------------------------------------------------- running
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train_args(out: Path, args: argparse.Namespace, sleep: float, workers: int) -> list[str]:
    """The arguments of ``train.py``; the elastic check rebuilds the run's loader from them."""
    return [
        "--out", str(out), "--num-workers", str(workers), "--epochs", str(args.epochs), "--save-every",
        str(args.save_every), "--sleep", str(sleep), "--samples", str(args.samples), "--batch-size",
        str(args.batch_size),
    ]


def launch_command(out: Path, args: argparse.Namespace, port: int, sleep: float, processes: int = 2,
                   workers: Optional[int] = None) -> list[str]:
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
        str(port), str(TRAIN), *train_args(out, args, sleep, args.num_workers if workers is None else workers),
    ]


def start(command: list[str], log: Path) -> subprocess.Popen:
    # ACCELERATE_USE_CPU with --multi_gpu gives a real 2-process gloo job; `--cpu` alone would not distribute.
    env = {k: v for k, v in os.environ.items() if k not in LEAKY_ENV and not k.startswith("ACCELERATE_")}
    env.update(ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log, "wb") as sink:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL every process of the job: the launcher, each rank and its data-loading workers.

    torch's launcher starts every rank in a session of its own, so killing the
    launcher's process group alone would leave the ranks training. Does nothing
    once the launcher has exited and been reaped (its pid may belong to another
    process by then).
    """
    if proc.poll() is not None:
        return
    # Unreaped, the launcher's pid cannot be reused, so this tree is the job's even if it exits meanwhile.
    launcher = psutil.Process(proc.pid)
    tree = [launcher] + launcher.children(recursive=True)
    groups = set()
    for process in tree:
        try:
            groups.add(os.getpgid(process.pid))
        except ProcessLookupError:
            pass  # already gone: nothing left to kill in its group that the others do not cover
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the whole group exited between listing and killing
    proc.wait()
    psutil.wait_procs(tree, timeout=30)


def echo_log(log: Path) -> None:
    """Show what the job printed (its start line, and e.g. the package removing an unfinished checkpoint)."""
    for line in log.read_text("utf-8", errors="replace").splitlines():
        if line.strip():
            print(f"    {line}")


@contextlib.contextmanager
def job(command: list[str], log: Path) -> Iterator[subprocess.Popen]:
    """Launch ``command``; no process of it outlives the block, whatever ends it (Ctrl-C included)."""
    proc = start(command, log)
    try:
        yield proc
    finally:
        kill_job(proc)
        echo_log(log)


def run_to_end(command: list[str], log: Path, timeout: float) -> None:
    with job(command, log) as proc:
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise DemoError(f"the launch did not finish within {timeout:.0f}s; see {log}") from None
    if code != 0:
        tail = "\n".join(log.read_text("utf-8", errors="replace").splitlines()[-30:])
        raise DemoError(f"the launch exited with status {code}; last lines of {log}:\n{tail}")


def progress(stream: Path, attempt: int) -> Optional[dict]:
    """The newest batch that ``attempt`` logged on this rank, or None."""
    if not stream.exists():
        return None
    for line in reversed(stream.read_text("utf-8").splitlines()):
        record = json.loads(line) if is_json(line) else None
        if record is not None and record["attempt"] == attempt and record["event"] == "batch":
            return record
    return None


class KillPoint(NamedTuple):
    """Kill once rank 0 trained ``fraction`` of ``epoch``; with ``during_save``, then wait for a save to start."""

    epoch: int
    fraction: float
    during_save: bool

    def reached(self, latest: Optional[dict], batches_per_epoch: Optional[int]) -> bool:
        if latest is None or batches_per_epoch is None:
            return False
        return (latest["epoch"], latest["batch"] + 1) >= (self.epoch, max(1, int(self.fraction * batches_per_epoch)))


def unfinished_checkpoints(run: Path) -> list[str]:
    """Checkpoint folders newer than the newest complete one: a save in progress, or one a kill cut short."""
    root = run / "checkpoints"
    newest = latest_checkpoint(root)
    floor = -1 if newest is None else _number(newest)
    return [p.name for p in sorted(root.glob("checkpoint_*"), key=_number) if _number(p) > floor]


def _number(path: Path) -> int:
    return int(path.name.rpartition("_")[2])


def run_until(command: list[str], log: Path, out: Path, attempt: int, point: KillPoint, args: argparse.Namespace
              ) -> dict:
    """Start the run and SIGKILL the whole job at ``point``; returns rank 0's last logged batch."""
    deadline = time.monotonic() + args.timeout
    stream, reached = out / "stream_rank0.jsonl", False
    with job(command, log) as proc:
        while proc.poll() is None and time.monotonic() < deadline:
            latest = progress(stream, attempt)
            reached = reached or point.reached(latest, _batches_per_epoch(stream))
            # A save takes a few milliseconds here, so watch for its folder, not for the step that starts it.
            if reached and (not point.during_save or (latest["step"] % args.save_every == 0
                                                       and unfinished_checkpoints(out))):
                kill_job(proc)
                return progress(stream, attempt)
            time.sleep(0.001 if reached else 0.01)
        what = "no checkpoint was caught being written" if reached else f"it never reached {point.fraction:.0%}"
        raise DemoError(f"attempt {attempt} ended (status {proc.poll()}) before the kill point in epoch "
                        f"{point.epoch}: {what}; move --kill-at earlier or raise --sleep; see {log}")


def _batches_per_epoch(stream: Path) -> Optional[int]:
    if not stream.exists():
        return None
    first = stream.read_text("utf-8").split("\n", 1)[0]
    return json.loads(first)["batches_per_epoch"] if is_json(first) else None


# --------------------------------------------------------------------------- main
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "demo_runs", help="removed and recreated")
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=7)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--sleep", type=float, default=0.1, help="seconds per step of the interrupted run")
    parser.add_argument("--kill-at", action="append", type=_kill_point, metavar="EPOCH:FRACTION[:save]",
                        help="kill once rank 0 trained this fraction of this epoch; with ':save', on the next "
                             "checkpoint step, while the checkpoint is written (repeatable; default 1:0.5 and "
                             "2:0.3:save)")
    parser.add_argument("--elastic-processes", type=int, default=3,
                        help="processes that resume a copy of the job the first kill left (0: skip that part)")
    parser.add_argument("--elastic-workers", type=int, default=1, help="data-loading workers of that resume")
    parser.add_argument("--self-check", action="store_true", help="also check that damaged streams are rejected")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per launch")
    args = parser.parse_args(argv)
    args.kill_at = sorted(args.kill_at or [KillPoint(1, 0.5, False), KillPoint(2, 0.3, True)])
    if any(point.epoch >= args.epochs for point in args.kill_at):
        parser.error(f"every --kill-at epoch must be below --epochs={args.epochs}")
    if args.elastic_processes in (1, 2) or args.elastic_processes < 0:
        parser.error(f"--elastic-processes must be 0 (skip) or 3 or more (the run has 2), got {args.elastic_processes}")
    return args


def _kill_point(text: str) -> KillPoint:
    parts = text.split(":")
    try:
        if len(parts) not in (2, 3) or parts[2:] not in ([], ["save"]):
            raise ValueError(text)
        return KillPoint(int(parts[0]), float(parts[1]), parts[2:] == ["save"])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected EPOCH:FRACTION or EPOCH:FRACTION:save such as 1:0.5, "
                                         f"got {text!r}") from None


def _newest_complete(run: Path) -> Optional[str]:
    path = latest_checkpoint(run / "checkpoints")
    return None if path is None else path.name


def fresh_output(out: Path) -> None:
    """Empty ``out`` for a new demo, refusing to delete a folder that holds anything but an earlier demo."""
    if out.exists():
        foreign = [p.name for p in out.iterdir() if p.name not in OUTPUTS and p.suffix != ".log"]
        if foreign:
            raise DemoError(f"--out {out} holds {', '.join(sorted(foreign)[:5])}, which the demo did not write; "
                            "pass an empty or new folder")
        shutil.rmtree(out)
    out.mkdir(parents=True)


class Outcome(NamedTuple):
    """What the demo found: the same-size verdict, the elastic one (None when skipped), the self-check's."""

    verdict: Verdict
    elastic: Optional[_elastic.ElasticVerdict]
    self_check: dict[str, str]


def run_demo(args: argparse.Namespace) -> Outcome:
    fresh_output(args.out)
    port = free_port()
    reference, interrupted, elastic = (args.out / name for name in OUTPUTS[:3])
    print(f"[1/4] reference run, uninterrupted -> {reference}")
    run_to_end(launch_command(reference, args, port, sleep=0.0), args.out / "reference.log", args.timeout)
    command = launch_command(interrupted, args, port, sleep=args.sleep)
    print(f"[2/4] interrupted run -> {interrupted}\n      command: ACCELERATE_USE_CPU=1 {' '.join(command)}")
    newest = []
    for attempt, point in enumerate(args.kill_at):
        last = run_until(command, args.out / f"interrupted.{attempt}.log", interrupted, attempt, point, args)
        newest.append(_newest_complete(interrupted))
        cut = unfinished_checkpoints(interrupted)
        cut = f", leaving {', '.join(cut)} incomplete (no manifest)" if cut else ""
        print(f"    SIGKILL to the whole job after step {last['step']} (epoch {last['epoch']}, batch "
              f"{last['batch']}){cut}; newest complete checkpoint: {newest[-1]}. Same command again:")
        if attempt == 0 and args.elastic_processes:
            shutil.copytree(interrupted, elastic)  # part 4 resumes this copy on another number of processes
    run_to_end(command, args.out / f"interrupted.{len(args.kill_at)}.log", args.timeout)
    print("[3/4] verifying the interrupted run against the reference")
    verdict = verify(reference, interrupted, newest)
    print_verdict(verdict)
    outcomes = _verify.self_check(reference, interrupted, args.out / "self_check") if args.self_check else {}
    elastic_verdict = None
    if args.elastic_processes:
        elastic_verdict, checked = run_elastic(elastic, args, port)
        outcomes.update(_elastic.self_check(*checked) if args.self_check else {})
    return Outcome(verdict, elastic_verdict, outcomes)


def run_elastic(run: Path, args: argparse.Namespace, port: int) -> tuple[_elastic.ElasticVerdict, tuple]:
    """Resume the copy of the job the first kill left on ``--elastic-processes`` processes, to the end; check it.

    Returns the verdict and the arguments it was drawn from (for the self-check).
    """
    path = latest_checkpoint(run / "checkpoints")
    if path is None:
        raise DemoError("the first kill left no complete checkpoint to resume on other processes; move the first "
                        "--kill-at later")
    checkpoint, states = _elastic.read_states(path)  # now: the new run's rotation will delete the folder
    world, workers = args.elastic_processes, args.elastic_workers
    command = launch_command(run, args, port, sleep=args.sleep, processes=world, workers=workers)
    print(f"[4/4] elastic resume: the job as the first kill left it ({checkpoint.name}, copied to {run}), "
          f"the same command with --num_processes {world} and --num-workers {workers}:\n"
          f"      command: ACCELERATE_USE_CPU=1 {' '.join(command)}")
    log = args.out / "elastic.log"
    run_to_end(command, log, args.timeout)
    print(f"  checking it against {world} ranks simulated in this process, each loading {checkpoint.name}'s "
          "loader state")
    simulated = train.parse_args(train_args(run, args, args.sleep, workers=0))
    sim = _elastic.simulate(lambda: train.make_loader(simulated), states, world, args.epochs)
    checked = (_elastic.read_streams(run, max(2, world)), checkpoint, sim, log.read_text("utf-8", errors="replace"))
    verdict = _elastic.verify_elastic(*checked)
    _elastic.print_elastic(verdict)
    return verdict, checked


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # As an exception, a SIGTERM (a test timeout, a CI cancel) still runs the cleanup that kills the jobs.
    sys.exit(128 + signum)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    began = time.monotonic()
    try:
        outcome = run_demo(args)
    except DemoError as exc:
        print(f"DEMO FAILED: {exc}")
        return 2
    elapsed = time.monotonic() - began
    if not outcome.verdict.ok:
        print(f"RESULT: DIFFERENT: the resumed run did not continue exactly ({elapsed:.0f}s)")
        return 1
    if outcome.elastic is not None and not outcome.elastic.ok:
        print(f"RESULT: DIFFERENT: the resume on {args.elastic_processes} processes broke its promise "
              f"({elapsed:.0f}s)")
        return 1
    missed = [name for name, result in outcome.self_check.items() if result == _verify.MISSED]
    if missed:
        print(f"RESULT: SELF-CHECK FAILED: the verifier accepted damaged streams: {', '.join(missed)}")
        return 1
    elastic = "" if outcome.elastic is None else (
        f"; ELASTIC OK: resumed on {args.elastic_processes} processes, every rank exactly as simulated")
    print(f"RESULT: IDENTICAL: {len(args.kill_at)} kills, every rank trained exactly the reference's batches"
          f"{elastic} ({elapsed:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
