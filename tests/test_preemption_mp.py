"""Preemption checkpoints on 2 real processes (issue 25): decided once per optimizer step, taken at the end of
that step, never a collective inside a loader's ``next()``. One launch runs every scenario of
``mp_preemption.py``; each must end without a hang, exit 143 when preempted, and resume to the uninterrupted
run's final weights, bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mp_harness import accelerate_command, launch

SCRIPT = Path(__file__).resolve().parent / "mp_preemption.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("preemption")
    job = launch([accelerate_command(SCRIPT, [root])], root, timeout_s=240, collective_timeout_s=40)
    assert job.ok, job.report()
    return json.loads((root / "results.json").read_text())


@pytest.mark.parametrize("scenario", ["eval-at-top-of-step", "accumulation-signal-inside-window"])
def test_a_signal_while_a_step_evaluates_after_drawing_its_batch_resumes_to_the_same_weights(results, scenario):
    found = results[scenario]
    assert found["exit"] == 143
    assert found["resumed"]["weights"] == found["reference"]["weights"]


def test_with_accumulation_the_checkpoint_is_taken_only_at_a_real_optimizer_step(results):
    found = results["accumulation-signal-inside-window"]
    assert found["resumed"]["taken_at_start"] % 2 == 0 and found["resumed"]["taken_at_start"] > 0


def test_an_uneven_evaluation_neither_hangs_nor_changes_the_resumed_run(results):
    found = results["uneven-eval"]
    assert found["exit"] == 143
    assert found["resumed"]["weights"] == found["reference"]["weights"]


def test_an_evaluation_on_the_main_process_only_does_not_hang(results):
    assert len(results["main-process-only-eval"]["reference"]["weights"]) == 2
