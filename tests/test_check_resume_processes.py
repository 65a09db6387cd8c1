"""``check-resume --processes`` on real 2- and 3-process gloo runs (``accelerate launch``, CPU): a correct script
resumed 2 -> 3 -> 2 processes is identical in samples, and a batch lost at the resume on 3 processes is caught.

The script (``tests/check_resume_train.py``) keeps a global batch of 6 samples on any process count and saves
after steps 2 and 6: a kill once the records reach step 3 resumes from step 2, one at step 7 from step 6.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from cli_run import run_subprocess
from mp_harness import accelerate_command

SCRIPT = Path(__file__).resolve().parent / "check_resume_train.py"


def _check(runs: Path, *args: object, bug: str = "") -> tuple[int, str]:
    script = accelerate_command(SCRIPT, ["--bug", bug] if bug else [])
    command = ["env", "ACCELERATE_USE_CPU=1", "OMP_NUM_THREADS=1", *script]
    done = run_subprocess([sys.executable, "-m", "accelerate_stateful", "check-resume", "--runs", runs, *args, "--",
                           *command], timeout=900)
    return done.returncode, done.stdout + done.stderr


@pytest.fixture(scope="module")
def correct(tmp_path_factory) -> tuple[int, str, Path]:
    runs = tmp_path_factory.mktemp("processes")
    status, out = _check(runs, "--processes", "2,3,2", "--at", "3,7")
    return status, out, runs / "uninterrupted" / "records"


def test_a_correct_script_resumed_from_two_to_three_to_two_processes_has_the_uninterrupted_runs_samples(correct):
    status, out, _ = correct
    assert status == 0, out
    assert re.search(r"run 2 with 3 process\(es\): resumed from checkpoint_\d+ \(saved after step 2\)", out), out
    assert re.search(r"run 3 with 2 process\(es\): resumed from checkpoint_\d+ \(saved after step 6\)", out), out
    assert ("identical samples on every number of processes: every step's samples, all ranks together, are those "
            "of the uninterrupted run (8 steps on 2 rank(s), 2 kill(s), 2 resume(s)); losses and parameters' norm "
            "equal within a relative 0.0001 (not bitwise") in out


def test_a_batch_lost_at_a_resume_on_three_processes_is_caught_naming_the_step(correct, tmp_path):
    status, out = _check(tmp_path, "--reference", correct[2], "--processes", "2,3", "--at", "3", bug="drop")
    assert status == 1, out
    assert "DIFFERENT samples from step 3 (all ranks together; after kill 1: SIGKILL at step" in out
    assert re.search(r"came     samples of the step on all ranks: rank 0 \[.*rank 2 \[", out), out
