"""The demo's verifier, on synthetic streams, and the demo itself, end to end (kill, restart, compare)."""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

DEMO_PATH = Path(__file__).resolve().parent.parent / "examples" / "demo.py"
SAMPLES, BATCH, WORLD, EPOCHS = 20, 3, 2, 2
STEPS_PER_EPOCH = -(-SAMPLES // (BATCH * WORLD))


def _load_demo():
    spec = importlib.util.spec_from_file_location("examples_demo", DEMO_PATH)
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up in sys.modules while the module executes.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


demo = _load_demo()


def batch_ids(rank: int, step: int) -> list[int]:
    """Rank ``rank``'s ids at global ``step`` (1-based): Accelerate's striping, last step padded by wrapping."""
    epoch, index = divmod(step - 1, STEPS_PER_EPOCH)
    order = random.Random(epoch).sample(range(SAMPLES), SAMPLES)
    start = (index * WORLD + rank) * BATCH
    return [order[p % SAMPLES] for p in range(start, start + BATCH)]


def write_run(out: Path, attempts: list[tuple[int, int, Optional[str]]], shift: int = 0) -> None:
    """Write each rank's stream for process starts ``(restored step, last step trained, checkpoint)``.

    ``shift`` makes every process after the first train the batch ``shift`` steps ahead of the right one.
    """
    out.mkdir(parents=True)
    for rank in range(WORLD):
        lines = []
        for attempt, (first, last, checkpoint) in enumerate(attempts):
            lines.append({
                "event": "start", "attempt": attempt, "rank": rank, "world_size": WORLD,
                "resumed_from": checkpoint, "step": first, "epoch": first // STEPS_PER_EPOCH,
                "batch": first % STEPS_PER_EPOCH, "batches_per_epoch": STEPS_PER_EPOCH, "dataset_size": SAMPLES,
            })
            for step in range(first + 1, last + 1):
                source = step + (shift if attempt else 0)
                lines.append({
                    "event": "batch", "attempt": attempt, "rank": rank, "step": step,
                    "epoch": (step - 1) // STEPS_PER_EPOCH, "batch": (step - 1) % STEPS_PER_EPOCH,
                    "ids": batch_ids(rank, source), "loss": 1.0 / source,
                })
        text = "".join(json.dumps(line) + "\n" for line in lines)
        (out / f"stream_rank{rank}.jsonl").write_text(text, "utf-8")


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    """A reference run and one killed after step 6, restarted from the checkpoint of step 4."""
    total = EPOCHS * STEPS_PER_EPOCH
    write_run(tmp_path / "reference", [(0, total, None)])
    write_run(tmp_path / "interrupted", [(0, 6, None), (4, total, "checkpoint_1")])
    return tmp_path


def test_verifier_accepts_an_exact_resume_and_counts_the_retrained_steps(runs: Path):
    verdict = demo.verify(runs / "reference", runs / "interrupted", ["checkpoint_1"])

    assert verdict.ok, [r.problems for r in verdict.ranks] + verdict.epoch_problems
    assert [(r.checkpoint, r.step, r.replayed) for r in verdict.ranks[0].resumes] == [("checkpoint_1", 4, 2)]
    assert len(verdict.ranks[1].effective) == EPOCHS * STEPS_PER_EPOCH


def test_self_check_sees_the_verifier_reject_every_damaged_stream(runs: Path):
    outcomes = demo.self_check(runs / "reference", runs / "interrupted", runs / "self_check")

    assert outcomes == {name: demo.REJECTED for name in demo.PERTURBATIONS}


def test_verifier_rejects_a_resume_that_continues_one_batch_late(tmp_path: Path):
    total = EPOCHS * STEPS_PER_EPOCH
    write_run(tmp_path / "reference", [(0, total, None)])
    write_run(tmp_path / "interrupted", [(0, 4, None), (4, total, "checkpoint_1")], shift=1)

    verdict = demo.verify(tmp_path / "reference", tmp_path / "interrupted")

    assert not verdict.ok
    assert "first difference from the reference at step 5: ids" in verdict.ranks[0].problems[0]


def test_verifier_rejects_a_restart_from_an_older_checkpoint_than_the_newest(runs: Path):
    verdict = demo.verify(runs / "reference", runs / "interrupted", ["checkpoint_2"])

    assert verdict.ranks[0].problems == [
        "restart 1 loaded checkpoint_1, but the newest complete checkpoint was checkpoint_2"
    ]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_demo_kills_a_two_process_run_twice_and_it_resumes_identically(tmp_path: Path):
    command = [
        sys.executable, str(DEMO_PATH), "--out", str(tmp_path / "runs"), "--samples", "120", "--epochs", "2",
        "--save-every", "3", "--kill-at", "0:0.6", "--kill-at", "1:0.3:save", "--self-check", "--timeout", "120",
    ]

    demo_run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = demo_run.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        demo_run.terminate()  # SIGTERM lets the demo kill its training jobs before it exits
        output, _ = demo_run.communicate(timeout=60)
        pytest.fail(f"the demo did not finish within 240s:\n{output}")

    assert demo_run.returncode == 0, output
    assert "IDENTICAL" in output
    assert "NOT DETECTED" not in output
