"""Kill a 2-process training run at random instants, restart it each time, and require the uninterrupted stream.

The run is ``tests/torture_train.py`` (``examples/train.py`` with ``total_limit=1``)
under ``accelerate launch`` on gloo, one data-loading worker per rank. Each kill is
aimed at a random step, either anywhere in that step (training, logging, loading
data) or inside the next ``save_state`` (at a random delay after the checkpoint
folder appeared), and sends SIGKILL to every process of the job: launcher,
ranks and workers. After each kill the test checks that no process survived,
that the newest complete checkpoint is at least the last one rank 0 had
finished (``total_limit=1`` deletes the previous one, so a kill in a save must
not leave none), and records where on disk the kill left the checkpoints.
The same command then starts again. At the end, ``examples/demo.py``'s verifier
requires every rank's stream to equal an uninterrupted run's (same steps,
sample ids and order, batch boundaries, losses), each restart to have loaded
the newest complete checkpoint, and every re-trained step to repeat exactly.

``TORTURE_KILLS`` (default 4) sets the number of kills, ``TORTURE_SEED`` the
seed of the kill plan (default 0; printed), ``TORTURE_LIMITS`` the
``total_limit`` values to run (default ``1``; ``make torture`` runs ``1,3``).
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple, Optional

import psutil
import pytest

from accelerate_stateful import latest_checkpoint
from accelerate_stateful.checkpoint import _files
import mp_harness
from scripts import load_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "torture_train.py"

KILLS = int(os.environ.get("TORTURE_KILLS", "4"))
SEED = int(os.environ.get("TORTURE_SEED", "0"))
LIMITS = [int(v) for v in os.environ.get("TORTURE_LIMITS", "1").split(",")]
SAMPLES, BATCH, WORLD, SAVE_EVERY, WORKERS = 120, 4, 2, 2, 1
STEPS_PER_EPOCH = math.ceil(SAMPLES / (BATCH * WORLD))
EPOCHS = max(3, math.ceil((2 * KILLS + 3 * SAVE_EVERY) / STEPS_PER_EPOCH))
TOTAL_STEPS = EPOCHS * STEPS_PER_EPOCH
STEP_SLEEP, SAVE_SLEEP = 0.03, 0.05
LAUNCH_TIMEOUT_S = 120


def _load_demo():
    return load_script("examples/demo.py", "examples_demo")


demo = _load_demo()


class Kill(NamedTuple):
    """Kill once rank 0 logged ``step``: ``delay`` s later (``"step"``), or inside the next save (``"save"``)."""

    step: int
    mode: str
    delay: float


def kill_plan(count: int, seed: int) -> list[Kill]:
    """``count`` kills at increasing random steps, half of them (rounded up) aimed inside a save.

    A save kill waits a random delay after the checkpoint folder appears (so it may land after the save);
    the first one does not wait.
    """
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(1, TOTAL_STEPS - 2 * SAVE_EVERY), count))
    modes = ["save" if i % 2 == 0 else "step" for i in range(count)]
    rng.shuffle(modes)
    plan = [Kill(s, m, rng.uniform(0, STEP_SLEEP if m == "step" else SAVE_SLEEP + 0.02)) for s, m in zip(steps, modes)]
    first = modes.index("save") if "save" in modes else None
    if first is not None:  # at once: this one lands inside the save's sleep, so the test can require one
        plan[first] = plan[first]._replace(delay=0.0)
    return plan


def command(out: Path, port: int, limit: int, sleep: float, save_sleep: float) -> list[str]:
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(WORLD),
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port),
        str(SCRIPT), "--out", str(out), "--num-workers", str(WORKERS), "--epochs", str(EPOCHS),
        "--save-every", str(SAVE_EVERY), "--sleep", str(sleep), "--samples", str(SAMPLES),
        "--batch-size", str(BATCH), "--total-limit", str(limit), "--save-sleep", str(save_sleep), "--lr", "0.01",
    ]


def kill_everything(job: mp_harness.Job) -> list[psutil.Process]:
    """SIGKILL the launcher, every rank and every worker (by id, through the harness); return them."""
    job.kill()
    return job.launchers + list(job.seen.values())


def survivors(tree: list[psutil.Process]) -> list[str]:
    alive = []
    for process in tree:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{process.pid} {' '.join(process.cmdline())[:80]}")
        except psutil.NoSuchProcess:
            pass
    return alive


def disk_state(root: Path, limit: int) -> str:
    """Where the kill left the checkpoints, read from the folders."""
    numbered = _files.numbered_checkpoints(root)
    complete = [p for p in numbered if _files.is_complete(p)]
    newest = _files.checkpoint_number(complete[0]) if complete else -1
    unfinished = [p for p in numbered if _files.checkpoint_number(p) > newest]
    half_deleted = [p for p in numbered if _files.checkpoint_number(p) < newest and p not in complete]
    if unfinished:
        ours = list((unfinished[0] / _files.SUBDIR).glob("loader_*.json"))
        theirs = [p for p in unfinished[0].iterdir() if p.is_file()]
        stage = f"{len(ours)}/{WORLD} loader states written" if ours else f"Accelerate's part, {len(theirs)} files"
        return f"inside a save ({unfinished[0].name} without manifest, {stage})"
    if half_deleted:
        return f"inside the rotation ({half_deleted[0].name} half deleted)"
    if len(complete) > limit:
        return f"between a manifest and the rotation ({len(complete)} complete checkpoints, limit {limit})"
    return "between saves"


def run_and_kill(cmd: list[str], folder: Path, out: Path, attempt: int, kill: Kill) -> tuple[dict, list[str]]:
    """Start the job, SIGKILL all of it at ``kill``; returns rank 0's last logged batch and any survivors."""
    stream = out / "stream_rank0.jsonl"
    job = mp_harness.start(cmd, folder)
    proc = job.procs[0]
    try:
        deadline, size = time.monotonic() + LAUNCH_TIMEOUT_S, -1
        while proc.poll() is None and time.monotonic() < deadline:
            # Polling competes with the two ranks for two cores: read the stream only when it grew.
            grown = stream.exists() and stream.stat().st_size != size
            latest = demo.progress(stream, attempt) if grown else None
            size = stream.stat().st_size if grown else size
            if latest is not None and latest["step"] >= kill.step:
                if kill.mode == "step" or _wait_for_save(proc, out, latest):
                    time.sleep(kill.delay)
                    tree = kill_everything(job)
                    return demo.progress(stream, attempt), survivors(tree)
            time.sleep(0.005)
        done = mp_harness.finish(job, timeout_s=0)
        pytest.fail(f"attempt {attempt} ended before {kill}:\n{done.report()}")
    finally:
        job.kill()
    raise AssertionError("unreachable")


def _wait_for_save(proc: subprocess.Popen, out: Path, latest: dict) -> bool:
    """Whether a save is under way: rank 0 logged a checkpoint step and its folder has no manifest yet.

    Rank 0 logs the step, then calls ``save_state``, so on a checkpoint step this waits (watching the
    folder closely) until the save's folder shows up or the step after it is logged.
    """
    if latest["step"] % SAVE_EVERY != 0:
        return False
    root = out / "checkpoints"
    number = latest["step"] // SAVE_EVERY - 1
    folder = root / f"checkpoint_{number}"
    for _ in range(2000):
        if proc.poll() is not None:
            return False
        if folder.exists() and not (folder / _files.SUBDIR / _files.MANIFEST).exists():
            return True
        if (folder / _files.SUBDIR / _files.MANIFEST).exists():
            return False  # the save finished between two looks; aim at the next one
        time.sleep(0.001)
    return False


def newest_after_kill(root: Path, last_step: int, guaranteed: int) -> tuple[Optional[Path], int]:
    """The newest complete checkpoint, checked against the newest one known complete; and the new floor.

    Rank 0 logged ``last_step`` after every save of an earlier step had returned, so those were complete;
    so was the newest at the previous kill. With ``total_limit=1`` a kill inside a save must keep one.
    """
    done = (last_step - 1) // SAVE_EVERY * SAVE_EVERY
    if done > 0:
        guaranteed = max(guaranteed, done // SAVE_EVERY - 1)
    newest = latest_checkpoint(root)
    number = -1 if newest is None else _files.checkpoint_number(newest)
    assert number >= guaranteed, (f"after a kill at step {last_step} the newest complete checkpoint is {newest}, "
                                  f"but checkpoint_{guaranteed} had been completed")
    return newest, number


def wait_to_end(job: mp_harness.Job) -> None:
    done = mp_harness.finish(job, timeout_s=LAUNCH_TIMEOUT_S, stall_s=0.75 * mp_harness.COLLECTIVE_TIMEOUT_S)
    assert done.ok, done.report()


@pytest.mark.multiprocess
@pytest.mark.timeout(300 + 30 * KILLS)
@pytest.mark.parametrize("limit", [pytest.param(v, id=f"total_limit={v}") for v in LIMITS])
def test_a_run_killed_at_random_instants_ends_with_the_uninterrupted_streams(tmp_path, limit):
    plan = kill_plan(KILLS, SEED)
    print(f"seed {SEED}: {KILLS} kills over {TOTAL_STEPS} steps: {plan}")
    began = time.monotonic()
    reference, run = tmp_path / "reference", tmp_path / "run"
    # The reference runs beside the first attempt: launches are slow here, and their timing does not matter.
    ref_job = mp_harness.start(command(reference, demo.free_port(), limit, 0.0, 0.0), tmp_path / "reference.launch")
    cmd = command(run, demo.free_port(), limit, STEP_SLEEP, SAVE_SLEEP)
    expected: list[Optional[str]] = []
    guaranteed = -1  # the newest checkpoint number known complete
    where: list[str] = []
    try:
        for attempt, kill in enumerate(plan):
            started = time.monotonic()
            last, alive = run_and_kill(cmd, tmp_path / f"attempt{attempt}", run, attempt, kill)
            assert not alive, f"kill {attempt} left processes running: {alive}"
            newest, guaranteed = newest_after_kill(run / "checkpoints", last["step"], guaranteed)
            expected.append(None if newest is None else newest.name)
            where.append(disk_state(run / "checkpoints", limit))
            print(f"kill {attempt} ({time.monotonic() - started:.1f} s after the launch): {kill.mode} kill after step "
                  f"{last['step']} ({where[-1]}); restart loads {None if newest is None else newest.name}")
        started = time.monotonic()
        wait_to_end(mp_harness.start(cmd, tmp_path / "final"))
        print(f"last start ran to the end in {time.monotonic() - started:.1f} s")
        wait_to_end(ref_job)
    finally:
        ref_job.kill()

    verdict = demo.verify(reference, run, expected)
    demo.print_verdict(verdict)
    print(f"{KILLS} kills ({sum('inside' in w for w in where)} inside a save or rotation) in "
          f"{time.monotonic() - began:.0f} s")
    assert verdict.ok, [r.problems for r in verdict.ranks] + verdict.epoch_problems
    assert any("inside" in w for w in where), f"no kill landed inside a save: {where}"
    assert all(len(r.effective) == TOTAL_STEPS for r in verdict.ranks)
    remaining = _files.numbered_checkpoints(run / "checkpoints")
    assert len(remaining) == limit and all(_files.is_complete(p) for p in remaining), remaining
