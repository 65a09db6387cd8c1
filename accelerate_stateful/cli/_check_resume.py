"""``accelerate-stateful check-resume``: does the user's own command resume exactly? (``docs/check-resume.md``)

It runs the command once uninterrupted, then again from a fresh folder, killing it after chosen or random steps
and running the command again after each kill (a chain of resumes, each run on the processes and workers of its
turn: ``_check_setup.py``) until a run ends on its own. Every run records, per rank and per optimizer step, what
it trained on (``training/_record.py``, switched on through the environment); the chain's records, stitched at
each resume, must equal the uninterrupted run's (per rank, or all ranks together across process counts:
``_across.py``).

Kill points are steps or named moments found in the records (``_kill_points.py``): a run is killed (its whole
process group: ``accelerate launch`` starts children) as soon as its records reach the point, so where it stops
never depends on a timer. This module imports neither torch nor accelerate: the command's processes do.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ..training._record_switch import HOLD_ENV, RECORD_ENV
from ._jobtree import Job
from ._kill_points import NAMES, Point, points, resolve
from ._check_setup import Setup, Variant, counts, process_counts
from ._across import compare_across, stitch_across
from ._check_verdict import verdict_text
from ._stitch import RecordFiles, Verdict, compare, last_step, stitch

IDENTICAL, DIFFERENT, USAGE, FAILED = 0, 1, 2, 3
POLL_S = 0.01
LOOK_S = 0.25  # how often the run's processes are looked up while it runs
# Once the main process holds at the kill point, how long the other ranks have to hold there too (a rank that
# never reaches it, e.g. with an evaluation on the main process only, is signalled where it is after this).
HOLD_WAIT_S = 5.0
PREFIX = "check-resume:"


def register(commands: argparse._SubParsersAction) -> None:
    """Add the ``check-resume`` subcommand to the command line's parser."""
    check = commands.add_parser(
        "check-resume", help="run a command uninterrupted, then killed and resumed; compare what each trained on",
        description="Run COMMAND once uninterrupted, then again, killed after chosen or random steps and run again "
                    "after each kill until a run ends on its own; exit 0 only when every step's batches, losses "
                    "and weights match. See docs/check-resume.md.",
        epilog="exit codes: 0 identical, 1 a difference, 2 bad arguments, 3 a run failed on its own or recorded "
               "no steps")
    check.add_argument("--kills", type=int, default=3, metavar="K", help="how many kills, at random steps (default 3)")
    check.add_argument("--at", type=points, metavar="S,S",
                       help="kill after these steps, or at these moments of the uninterrupted run: "
                            f"{','.join(NAMES)} (mixable: 3,epoch-end,save), instead of random steps")
    check.add_argument("--chain", type=int, metavar="N",
                       help="resumes in a row from one fresh folder (default: every kill in one chain)")
    check.add_argument("--workers", type=counts, metavar="W,W",
                       help="DataLoader workers of each run in turn, e.g. 0,2: run k of a chain uses the k-th "
                            "(cycling), whatever the script's own num_workers")
    check.add_argument("--processes", type=process_counts, metavar="P,P",
                       help="processes of each run in turn, e.g. 2,3, written into the command's accelerate launch "
                            "--num_processes or torchrun --nproc_per_node; samples are then compared all ranks "
                            "together, losses and weights within a tolerance")
    check.add_argument("--seed", type=int, default=0, help="seed of the random kill steps (default 0)")
    check.add_argument("--signal", choices=["KILL", "TERM"], default="KILL", help="the kill's signal (default KILL)")
    check.add_argument("--workdir", type=Path, metavar="DIR",
                       help="a folder copied afresh for every chain (default: an empty folder); the command runs "
                            "inside it, so its output folders must be relative paths")
    check.add_argument("--reference", type=Path, metavar="DIR",
                       help="reuse the uninterrupted run of an earlier check of the same command: its records "
                            "folder (RUNS/uninterrupted/records)")
    check.add_argument("--runs", type=Path, metavar="DIR",
                       help="where the runs' folders, records and logs go (default: a new temporary folder)")
    check.add_argument("--timeout", type=float, metavar="S",
                       help="longest a run may take (default: 5 times the uninterrupted run, plus 60 s; none with "
                            "--reference)")
    check.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND...")
    check.set_defaults(run=run)


def say(line: str) -> None:
    print(f"{PREFIX} {line}", flush=True)


@dataclass
class Run:
    """One run of the command: how it ended, and the records it appended (per rank)."""

    number: int
    started: float
    took: float
    status: int
    killed_after: Optional[int]
    records: dict
    log: Path
    kill_at: Optional[Point] = None


def run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        return _usage("give the training command after '--', e.g. check-resume -- python train.py")
    if args.kills < 1 or (args.chain is not None and args.chain < 1):
        return _usage("--kills and --chain take a count of at least 1")
    if args.workdir is not None and not args.workdir.is_dir():
        return _usage(f"--workdir {args.workdir}: no such folder")
    for script in (Path(word) for word in command if word.endswith(".py")):
        if not script.is_absolute() and script.is_file() \
                and not (args.workdir is not None and (args.workdir / script).is_file()):
            return _usage(f"{script} is a relative path, and each run of the command starts in a fresh folder of its "
                          f"own, where it is not: give it as {script.resolve()}, or --workdir . to copy this "
                          "folder into every run")
    runs_dir = args.runs if args.runs is not None else Path(tempfile.mkdtemp(prefix="check-resume-"))
    say(f"runs, records and logs in {runs_dir}")
    sig = signal.SIGKILL if args.signal == "KILL" else signal.SIGTERM
    setup = Setup(command, args.workers, args.processes)
    try:
        setup.variant(1)
    except ValueError as error:
        return _usage(str(error))

    if args.reference is not None:
        if not args.reference.is_dir():
            return _usage(f"--reference {args.reference}: no such folder; give RUNS/uninterrupted/records of a check")
        ref_lines, took = RecordFiles(args.reference).take(), None
    else:
        reference = _run_command(setup.variant(1), _fresh(runs_dir / "uninterrupted", args.workdir), None, sig,
                                 args.timeout, 1)
        if reference.status != 0:
            return _failed(reference, "the uninterrupted run")
        ref_lines, took = reference.records, reference.took
    ref = stitch([ref_lines])
    total = max((max(s.steps, default=0) for s in ref.values()), default=0)
    say(f"uninterrupted run: {total} steps on {len(ref)} rank(s)" + _with(setup.variant(1)) + ", "
        + (f"{took:.1f} s" if took is not None else f"its records reused from {args.reference}"))
    if total < 2:
        return _fail("the uninterrupted run recorded fewer than 2 optimizer steps, so there is no point to kill it "
                     "between steps: does the script make its Accelerator, model and optimizer with "
                     "accelerate_stateful.Accelerator and accelerator.prepare(...)?", FAILED)
    timeout = args.timeout if args.timeout is not None else 5 * took + 60 if took is not None else None
    wanted = args.at or sorted(random.Random(args.seed).sample(range(1, total), min(args.kills, total - 1)))
    kills, missing = resolve(wanted, ref_lines)
    for name in missing:
        say(f"the kill at {name} cannot be made: the uninterrupted run never reached that moment")
    if not kills:
        return _usage("none of the kill points (--at) can be made: give steps, or moments the run reaches")
    size = args.chain or len(kills)
    for number, start in enumerate(range(0, len(kills), size), 1):
        chain = kills[start:start + size]
        code = _check_chain(setup, runs_dir / f"chain{number}", args.workdir, chain, sig, timeout,
                            _judge(ref_lines, args.processes is not None), number)
        if code != IDENTICAL:
            return code
    return IDENTICAL


def _judge(ref_lines: dict, across: bool) -> Callable[[list], tuple[Verdict, int]]:
    """The comparison of a chain's runs with the uninterrupted run's records, and the reference's rank count:
    per rank and bitwise, or, with ``--processes``, of all ranks' samples together (``_across.py``)."""
    if across:
        ref = stitch_across([ref_lines])
        return lambda runs: (compare_across(ref, stitch_across(runs)), len(ref_lines))
    stitched = stitch([ref_lines])
    return lambda runs: (compare(stitched, stitch(runs)), len(stitched))


def _check_chain(setup: Setup, folder: Path, workdir: Optional[Path], kills: list, sig: signal.Signals,
                 timeout: Optional[float], judge: Callable[[list], tuple[Verdict, int]], number: int) -> int:
    """One chain from a fresh folder: a run per kill point, then one that ends on its own; its verdict."""
    work, records = _fresh(folder, workdir), RecordFiles(folder / "records")
    runs: list[Run] = []
    pending = list(kills)
    while True:
        variant = setup.variant(len(runs) + 1)
        run_ = _run_command(variant, work, pending[0] if pending else None, sig, timeout, len(runs) + 1, records)
        runs.append(run_)
        resume = _resume_of(run_)
        _say_run(number, run_, resume, sig, variant)
        if resume is not None and resume.get("step") is None:
            return _fail(f"run {run_.number} of chain {number} resumed from {resume['checkpoint']}, which no run of "
                         "this check saved, so its steps cannot be matched: leave checkpoints out of --workdir",
                         FAILED)
        if run_.killed_after is None:
            if run_.status != 0:
                return _failed(run_, f"run {run_.number} of chain {number}")
            break
        pending = [p for p in pending[1:] if p.order > run_.killed_after]
    for point in pending:
        say(f"chain {number}: the kill at {point.describe()} was never reached: the run ended first")
    if len(runs) > 1 and not any(_resume_of(r) for r in runs):
        say(f"chain {number}: no run resumed (each kill came before a checkpoint was complete), so no resume was "
            "checked: kill later (--at) or save earlier")
    verdict, ranks = judge([r.records for r in runs])
    killed = [r.killed_after for r in runs]
    print(verdict_text(verdict, killed, sum(_resume_of(r) is not None for r in runs), sig, ranks))
    return IDENTICAL if verdict.kind == "identical" else DIFFERENT


def _fresh(folder: Path, workdir: Optional[Path]) -> Path:
    """``folder``/work, new: a copy of ``workdir``, or empty; the records go next to it."""
    if folder.exists():
        shutil.rmtree(folder)
    work = folder / "work"
    if workdir is not None:
        shutil.copytree(workdir, work, symlinks=True)
    else:
        work.mkdir(parents=True)
    return work


def _run_command(variant: Variant, work: Path, kill_at: Optional[Point], sig: signal.Signals, timeout: Optional[float],
                 number: int, records: Optional[RecordFiles] = None) -> Run:
    """Run the variant's command in ``work``; kill its process group with ``sig`` once its records reach
    step ``kill_at``."""
    records = records or RecordFiles(work.parent / "records")
    records.folder.mkdir(parents=True, exist_ok=True)
    log = work.parent / f"run{number}.log"
    env = {**os.environ, **variant.env, RECORD_ENV: str(records.folder.resolve())}
    env.pop(HOLD_ENV, None)
    if kill_at is not None:
        env[HOLD_ENV] = json.dumps(kill_at.hold())
    started = time.time()
    with log.open("w") as out:
        proc = subprocess.Popen(variant.command, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    job = Job(proc)
    try:
        killed_after, seen = _watch(job, records, kill_at, sig, timeout, started, log)
    finally:  # Ctrl-C of the checker too: the run is in sessions of its own, which the terminal never signals
        job.end()
    for rank, lines in records.take().items():
        seen.setdefault(rank, []).extend(lines)
    return Run(number, started, time.time() - started, proc.returncode, killed_after, seen, log, kill_at)


def _watch(job: Job, records: RecordFiles, kill_at: Optional[Point], sig: signal.Signals,
           timeout: Optional[float], started: float, log: Path) -> tuple[Optional[int], dict]:
    """Read the run's records while it runs; signal all its processes once they hold at ``kill_at``.

    Each process stops itself where its records reach the point (``HOLD_ENV``). The signal goes out once the
    main process holds and every other rank holds too, or ``HOLD_WAIT_S`` after the main process (a rank that
    does not reach the point); a process stopped there gets ``SIGCONT`` after a catchable ``sig``, to handle it.
    """
    seen: dict[int, list] = {}
    killed_after, looked, main_held = None, 0.0, None
    while job.proc.poll() is None:
        if time.monotonic() - looked > LOOK_S:  # its ranks may start sessions of their own (``_jobtree``)
            job.look()
            looked = time.monotonic()
        new = records.take()
        for rank, lines in new.items():
            seen.setdefault(rank, []).extend(lines)
        if kill_at is not None and main_held is None and _held(new.get(0, [])):
            main_held = time.monotonic()
        if main_held is not None and killed_after is None and (
                all(_held(lines) for lines in seen.values()) or time.monotonic() - main_held > HOLD_WAIT_S):
            job.signal(sig)
            if sig != signal.SIGKILL:
                job.signal(signal.SIGCONT)
            killed_after = last_step(seen) or 0
        if timeout is not None and time.time() - started > timeout:
            with log.open("a") as out:
                out.write(f"\n{PREFIX} stopped: still running after {timeout:.0f} s (--timeout)\n")
            break
        time.sleep(POLL_S)
    return killed_after, seen


def _held(lines: list[dict]) -> bool:
    return any(r.get("event") == "held" for r in lines)


def _resume_of(run_: Run) -> Optional[dict]:
    """The main process's ``resumed`` record of the run, if it loaded a checkpoint."""
    return next((r for r in run_.records.get(0, []) if r.get("event") == "resumed"), None)


def _with(variant: Variant) -> str:
    return f" with {variant.label}" if variant.label else ""


def _say_run(chain: int, run_: Run, resume: Optional[dict], sig: signal.Signals, variant: Variant) -> None:
    head = f"chain {chain}, run {run_.number}{_with(variant)}:"
    first = _first_step_s(run_)
    if run_.number == 1:
        start = "started fresh"
    elif resume:
        at = "an unrecorded step" if resume.get("step") is None else f"step {resume['step']}"
        start = f"resumed from {Path(resume['checkpoint']).name} (saved after {at})"
    else:
        start = "started fresh (no complete checkpoint to resume from)"
    timing = f", first step {first:.2f} s after its start" if first is not None else ", no step"
    end = (f"killed at {run_.kill_at.describe()} ({sig.name} sent once it had recorded step {run_.killed_after})"
           if run_.killed_after is not None else f"ended on its own (status {run_.status})")
    say(f"{head} {start}{timing}; {end}")


def _first_step_s(run_: Run) -> Optional[float]:
    times = [r["time"] for lines in run_.records.values() for r in lines if r.get("event") == "step"]
    return min(times) - run_.started if times else None


def _failed(run_: Run, which: str) -> int:
    tail = run_.log.read_text("utf-8", "replace").splitlines()[-15:]
    print("\n".join(f"  | {line}" for line in tail))
    return _fail(f"{which} failed on its own with status {run_.status} (its whole log: {run_.log}); make the "
                 "command run to its end before checking its resumes", FAILED)


def _usage(message: str) -> int:
    return _fail(message, USAGE)


def _fail(message: str, status: int) -> int:
    print(f"accelerate-stateful: error: {message}", file=sys.stderr, flush=True)
    return status
