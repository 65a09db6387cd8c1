"""Kill a 2-process training run mid-epoch, restart it with the same command, and prove nothing changed.

``make demo`` runs ``examples/train.py`` under ``accelerate launch`` (two CPU
processes on gloo) twice:

1. ``demo_runs/reference``: uninterrupted, start to finish.
2. ``demo_runs/interrupted``: killed with SIGKILL mid-epoch (every process of
   the job, data-loading workers included), then started again with the very
   same command, which resumes from the newest complete checkpoint; by default
   it is killed twice, in epochs 1 and 2.

Each rank of each run logs one JSON line per batch it trains on. The verifier
rebuilds the interrupted run's effective stream (for a step trained twice, the
copy from the later process) and requires, on every rank, the same steps,
epochs, sample ids in the same order, batch boundaries and losses as the
reference; the steps re-trained after a resume must repeat exactly what the
killed run had trained; and every epoch must cover the dataset, with no
sample repeated across ranks beyond the reference's own end-of-epoch padding.

``--self-check`` then damages copies of the interrupted streams (two ids
swapped, a batch dropped, a replayed step changed) and requires the verifier
to reject each one. The exit status is non-zero on any failure.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Optional

import psutil

from accelerate_stateful import latest_checkpoint

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "train.py"
# What must match between the reference and the resumed run, in the order a difference is reported.
FIELDS = ("step", "epoch", "batch", "ids", "loss")
# What the demo writes under --out besides its *.log files; anything else there is not the demo's to delete.
OUTPUTS = ("reference", "interrupted", "self_check")
# Launcher settings that would otherwise leak in from the caller's shell and change the job.
LEAKY_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class DemoError(Exception):
    """The demo could not run as planned (a launch failed, a kill point was never reached)."""


# --------------------------------------------------------------------------- reading streams
@dataclass
class Attempt:
    """One process start of a run: its start record and the batches it trained, in order."""

    start: dict
    batches: list[dict] = field(default_factory=list)


def read_stream(path: Path) -> list[Attempt]:
    """Split a rank's stream into attempts; a line cut short by a kill may only end an attempt."""
    attempts: list[Attempt] = []
    torn_at = None
    for number, line in enumerate(path.read_text("utf-8").splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            torn_at = number
            continue
        if record["event"] == "start":
            attempts.append(Attempt(record))
        elif not attempts:
            raise DemoError(f"{path}:{number}: a batch record before any start record")
        elif torn_at is not None:
            raise DemoError(f"{path}:{torn_at}: damaged line in the middle of attempt {len(attempts) - 1}")
        else:
            attempts[-1].batches.append(record)
        torn_at = None
    return attempts


def first_difference(want: dict, got: dict) -> Optional[str]:
    """The first of ``FIELDS`` where ``got`` differs from ``want``, said in words; None when they agree."""
    for name in FIELDS:
        if want.get(name) != got.get(name):
            return f"{name} {got.get(name)} instead of {want.get(name)}"
    return None


# --------------------------------------------------------------------------- verifying
@dataclass
class Resume:
    """A restart: what it loaded, where that put it, and how many steps it trained a second time."""

    attempt: int
    checkpoint: Optional[str]
    epoch: int
    batch: int
    step: int
    replayed: int = 0
    replay_mismatches: int = 0


@dataclass
class RankReport:
    """One rank's result: its effective stream and everything found wrong with it."""

    rank: int
    effective: list[dict]
    attempts: int
    resumes: list[Resume]
    problems: list[str]


def effective_stream(attempts: list[Attempt], problems: list[str]) -> tuple[list[dict], list[Resume]]:
    """The batches that count: for a step trained more than once, the later process's copy.

    Also checks that each attempt starts right after the step it restored and
    that a re-trained step repeats exactly what the killed process trained.
    """
    by_step: dict[int, dict] = {}
    resumes = []
    for index, attempt in enumerate(attempts):
        start = attempt.start
        resume = Resume(index, start["resumed_from"], start["epoch"], start["batch"], start["step"])
        if index:
            resumes.append(resume)
        previous = start["step"]
        for line in attempt.batches:
            if line["step"] != previous + 1:
                problems.append(f"attempt {index} goes from step {previous} to step {line['step']}")
            previous = line["step"]
            if line["step"] in by_step:
                resume.replayed += 1
                diff = first_difference(by_step[line["step"]], line)
                if diff:
                    resume.replay_mismatches += 1
                    problems.append(f"step {line['step']} re-trained after resume {index} differs from the "
                                    f"killed run: {diff}")
            by_step[line["step"]] = line
    return [by_step[step] for step in sorted(by_step)], resumes


def verify_rank(
    rank: int, reference: list[Attempt], interrupted: list[Attempt], expected: Optional[list[Optional[str]]]
) -> RankReport:
    """Compare one rank's interrupted run with its reference; ``expected`` as in :func:`verify`."""
    problems: list[str] = []
    if len(reference) != 1:
        problems.append(f"the reference run has {len(reference)} process starts; it must run once, uninterrupted")
    want, _ = effective_stream(reference, problems)
    got, resumes = effective_stream(interrupted, problems)
    if expected is not None:
        problems += resume_problems(resumes, expected)
    for reference_line, line in zip(want, got):
        diff = first_difference(reference_line, line)
        if diff:
            problems.append(f"first difference from the reference at step {reference_line['step']}: {diff}")
            break
    if len(want) != len(got):
        problems.append(f"the reference trained {len(want)} steps, the interrupted run {len(got)}")
    return RankReport(rank, got, len(interrupted), resumes, problems)


def resume_problems(resumes: list[Resume], expected: list[Optional[str]]) -> list[str]:
    """Each restart must load the newest checkpoint that was complete when the job was killed."""
    if len(resumes) != len(expected):
        return [f"{len(resumes)} restarts logged, {len(expected)} kills made"]
    return [
        f"restart {resume.attempt} loaded {resume.checkpoint}, but the newest complete checkpoint was {newest}"
        for resume, newest in zip(resumes, expected)
        if resume.checkpoint != newest
    ]


def epoch_ids(streams: list[list[dict]]) -> dict[int, list[int]]:
    """Every sample id trained in each epoch, all ranks together."""
    ids: dict[int, list[int]] = collections.defaultdict(list)
    for stream in streams:
        for line in stream:
            ids[line["epoch"]].extend(line["ids"])
    return ids


def check_epochs(reference: list[list[dict]], interrupted: list[list[dict]], size: int) -> tuple[list[str], list[str]]:
    """Each epoch covers the dataset; repeats across ranks are only the reference's own padding."""
    notes, problems = [], []
    want_ids, got_ids = epoch_ids(reference), epoch_ids(interrupted)
    for epoch in sorted(set(want_ids) | set(got_ids)):
        want, got = _repeats(want_ids[epoch]), _repeats(got_ids[epoch])
        missing = set(range(size)) - set(got_ids[epoch])
        if missing:
            problems.append(f"epoch {epoch}: {len(missing)} samples never trained, e.g. {sorted(missing)[:5]}")
        if got != want:
            problems.append(f"epoch {epoch}: samples trained more than once across ranks {dict(got)}, in the "
                            f"reference {dict(want)}")
        else:
            notes.append(f"epoch {epoch}: {size - len(missing)}/{size} samples, {sum(got.values())} trained twice "
                         "across ranks, exactly the reference's end-of-epoch padding")
    return notes, problems


def _repeats(ids: list[int]) -> collections.Counter:
    """How many extra times each id occurs."""
    counts = collections.Counter(ids)
    return counts - collections.Counter(counts.keys())


@dataclass
class Verdict:
    """The whole comparison: a report per rank and the epoch coverage across ranks."""

    ranks: list[RankReport]
    epoch_notes: list[str]
    epoch_problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.epoch_problems and not any(r.problems for r in self.ranks)


def verify(
    reference_dir: Path, interrupted_dir: Path, expected_checkpoints: Optional[list[Optional[str]]] = None
) -> Verdict:
    """Compare the interrupted run's streams with the reference's, rank by rank and epoch by epoch.

    Args:
        reference_dir: Output folder of the uninterrupted run.
        interrupted_dir: Output folder of the run that was killed and restarted.
        expected_checkpoints: For each kill, the name of the newest complete
            checkpoint at that moment (what the restart must load); not checked when None.
    """
    paths = sorted(reference_dir.glob("stream_rank*.jsonl"))
    if not paths:
        raise DemoError(f"no stream_rank*.jsonl under {reference_dir}")
    reports, reference = [], []
    for rank, path in enumerate(paths):
        ref = read_stream(path)
        other = interrupted_dir / path.name
        run = read_stream(other) if other.exists() else []
        reports.append(verify_rank(rank, ref, run, expected_checkpoints))
        reference.append(effective_stream(ref, [])[0])
        size = ref[0].start["dataset_size"]
    notes, problems = check_epochs(reference, [r.effective for r in reports], size)
    return Verdict(reports, notes, problems)


def print_verdict(verdict: Verdict) -> None:
    for report in verdict.ranks:
        steps = len(report.effective)
        print(f"  rank {report.rank}: {steps} steps over {report.attempts} process starts "
              f"({len(report.resumes)} kills)")
        for resume in report.resumes:
            where = resume.checkpoint or "nothing (fresh start)"
            replayed = f"{resume.replayed} step{'s' * (resume.replayed != 1)} re-trained"
            same = (f"{resume.replay_mismatches} DIFFERENT from" if resume.replay_mismatches else "identical to")
            print(f"    resume {resume.attempt}: from {where} at epoch {resume.epoch}, batch {resume.batch} "
                  f"(step {resume.step}); {replayed}, {same} what the killed run trained")
        print("    " + ("; ".join(report.problems) if report.problems else
                        "stream vs reference: IDENTICAL (steps, epochs, sample ids and order, batches, losses)"))
    for note in verdict.epoch_notes:
        print(f"  {note}")
    for problem in verdict.epoch_problems:
        print(f"  PROBLEM {problem}")


# --------------------------------------------------------------------------- self-check
def _last_attempt_start(records: list[dict]) -> int:
    return max(i for i, r in enumerate(records) if r["event"] == "start")


def swap_two_ids(records: list[dict]) -> bool:
    """Swap two ids inside a batch that only the last process trained (so only the reference can tell)."""
    last = _last_attempt_start(records)
    earlier = {r["step"] for r in records[:last] if r["event"] == "batch"}
    for record in records[last:]:
        if record["event"] == "batch" and record["step"] not in earlier and len(set(record["ids"])) > 1:
            ids = record["ids"]
            ids[0], ids[-1] = ids[-1], ids[0]
            return True
    return False


def drop_a_batch(records: list[dict]) -> bool:
    """Drop a batch from the middle of the last attempt."""
    batches = [i for i, r in enumerate(records) if r["event"] == "batch" and i > _last_attempt_start(records)]
    if len(batches) < 2:
        return False
    del records[batches[len(batches) // 2]]
    return True


def change_a_replayed_step(records: list[dict]) -> bool:
    """Change what the killed run trained at a step that the resumed run trained again."""
    last = _last_attempt_start(records)
    retrained = {r["step"] for r in records[last:] if r["event"] == "batch"}
    for record in records[:last]:
        if record["event"] == "batch" and record["step"] in retrained:
            record["ids"] = list(reversed(record["ids"])) if len(set(record["ids"])) > 1 else [-1]
            return True
    return False


PERTURBATIONS: dict[str, Callable[[list[dict]], bool]] = {
    "two ids swapped in a batch after the last resume": swap_two_ids,
    "a resumed batch dropped": drop_a_batch,
    "a re-trained step changed in the killed run": change_a_replayed_step,
}


REJECTED, MISSED, NOT_APPLICABLE = "rejected", "NOT DETECTED", "not applicable"


def self_check(reference_dir: Path, interrupted_dir: Path, work_dir: Path) -> dict[str, str]:
    """Damage copies of rank 0's interrupted stream and verify each; maps each damage to its outcome.

    The outcome is ``REJECTED`` (the verifier caught it), ``MISSED`` (it did
    not: the verifier is broken) or ``NOT_APPLICABLE`` (e.g. no step was re-trained).
    """
    stream = interrupted_dir / "stream_rank0.jsonl"
    records = [json.loads(line) for line in stream.read_text("utf-8").splitlines() if _is_json(line)]
    outcomes = {}
    for name, perturb in PERTURBATIONS.items():
        damaged = json.loads(json.dumps(records))
        if not perturb(damaged):
            outcomes[name] = NOT_APPLICABLE
            print(f"  self-check: {name}: {NOT_APPLICABLE} to this run")
            continue
        copy = work_dir / name.replace(" ", "_")
        shutil.copytree(interrupted_dir, copy, ignore=shutil.ignore_patterns("checkpoints", "*.log"))
        (copy / stream.name).write_text("".join(json.dumps(r) + "\n" for r in damaged), "utf-8")
        verdict = verify(reference_dir, copy)
        found = verdict.ranks[0].problems + verdict.epoch_problems
        outcomes[name] = MISSED if verdict.ok else REJECTED
        print(f"  self-check: {name}: {outcomes[name]}" + (f": {found[0]}" if found else ""))
    return outcomes


def _is_json(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


# --------------------------------------------------------------------------- running
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_command(out: Path, args: argparse.Namespace, port: int, sleep: float) -> list[str]:
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(port), str(TRAIN), "--out", str(out), "--num-workers", str(args.num_workers),
        "--epochs", str(args.epochs), "--save-every", str(args.save_every), "--sleep", str(sleep),
        "--samples", str(args.samples), "--batch-size", str(args.batch_size),
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
        record = json.loads(line) if _is_json(line) else None
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
    return json.loads(first)["batches_per_epoch"] if _is_json(first) else None


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
    parser.add_argument("--self-check", action="store_true", help="also check that damaged streams are rejected")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per launch")
    args = parser.parse_args(argv)
    args.kill_at = sorted(args.kill_at or [KillPoint(1, 0.5, False), KillPoint(2, 0.3, True)])
    if any(point.epoch >= args.epochs for point in args.kill_at):
        parser.error(f"every --kill-at epoch must be below --epochs={args.epochs}")
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


def run_demo(args: argparse.Namespace) -> Verdict:
    fresh_output(args.out)
    port = free_port()
    reference, interrupted = args.out / "reference", args.out / "interrupted"
    print(f"[1/3] reference run, uninterrupted -> {reference}")
    run_to_end(launch_command(reference, args, port, sleep=0.0), args.out / "reference.log", args.timeout)
    command = launch_command(interrupted, args, port, sleep=args.sleep)
    print(f"[2/3] interrupted run -> {interrupted}\n      command: ACCELERATE_USE_CPU=1 {' '.join(command)}")
    newest = []
    for attempt, point in enumerate(args.kill_at):
        last = run_until(command, args.out / f"interrupted.{attempt}.log", interrupted, attempt, point, args)
        newest.append(_newest_complete(interrupted))
        cut = unfinished_checkpoints(interrupted)
        cut = f", leaving {', '.join(cut)} incomplete (no manifest)" if cut else ""
        print(f"    SIGKILL to the whole job after step {last['step']} (epoch {last['epoch']}, batch "
              f"{last['batch']}){cut}; newest complete checkpoint: {newest[-1]}. Same command again:")
    run_to_end(command, args.out / f"interrupted.{len(args.kill_at)}.log", args.timeout)
    print("[3/3] verifying the interrupted run against the reference")
    verdict = verify(reference, interrupted, newest)
    print_verdict(verdict)
    return verdict


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # As an exception, a SIGTERM (a test timeout, a CI cancel) still runs the cleanup that kills the jobs.
    sys.exit(128 + signum)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    began = time.monotonic()
    try:
        verdict = run_demo(args)
        outcomes = self_check(args.out / "reference", args.out / "interrupted", args.out / "self_check") \
            if args.self_check else {}
    except DemoError as exc:
        print(f"DEMO FAILED: {exc}")
        return 2
    elapsed = time.monotonic() - began
    if not verdict.ok:
        print(f"RESULT: DIFFERENT: the resumed run did not continue exactly ({elapsed:.0f}s)")
        return 1
    missed = [name for name, outcome in outcomes.items() if outcome == MISSED]
    if missed:
        print(f"RESULT: SELF-CHECK FAILED: the verifier accepted damaged streams: {', '.join(missed)}")
        return 1
    print(f"RESULT: IDENTICAL: {len(args.kill_at)} kills, every rank trained exactly the reference's batches "
          f"({elapsed:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
