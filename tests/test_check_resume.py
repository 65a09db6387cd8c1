"""``accelerate-stateful check-resume`` catches planted resume bugs, naming the step, and passes a correct script.

The script (``tests/check_resume_train.py``, one process: ``python script.py`` keeps the file fast) saves after
steps 2 and 6; the checker kills it at step 3 (the run stops itself there and is signalled while stopped), so
the resumed run continues from step 2. The expected step is read from the checker's own line about the resume.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from accelerate_stateful.training import _record_switch
from accelerate_stateful.cli._stitch import RecordFiles, compare, stitch

from cli_run import run_subprocess

SCRIPT = Path(__file__).resolve().parent / "check_resume_train.py"


def _check(runs: Path, *args: object, bug: str = "") -> tuple[int, str, int]:
    """(exit status, output, the step the resumed run continued from) of a check with one kill after step 3."""
    done = run_subprocess([sys.executable, "-m", "accelerate_stateful", "check-resume", "--runs", runs, *args, "--",
                           sys.executable, SCRIPT, *(["--bug", bug] if bug else [])], timeout=600)
    out = done.stdout + done.stderr
    resumed = re.search(r"resumed from checkpoint_\d+ \(saved after step (\d+)\)", out)
    assert resumed, out
    return done.returncode, out, int(resumed.group(1))


@pytest.fixture(scope="module")
def correct(tmp_path_factory) -> tuple[int, str, Path]:
    """A check of the correct script; its uninterrupted run is the reference of the planted bugs' checks (a bug
    acts only after a resume, so their uninterrupted runs are this one: each process start costs seconds)."""
    runs = tmp_path_factory.mktemp("correct")
    status, out, _ = _check(runs, "--workers", "0,2", "--at", "3,99")
    return status, out, runs / "uninterrupted" / "records"


def test_a_correct_script_is_identical_resumed_on_other_workers_and_an_unreached_kill_point_is_reported(correct):
    status, out, _ = correct
    assert status == 0, out
    assert "uninterrupted run: 8 steps on 1 rank(s) with 0 DataLoader worker(s)" in out
    assert "identical: every batch, loss and weight of the 8 steps on 1 rank(s), 1 kill(s), 1 resume(s)" in out
    assert "the kill at step 99 was never reached: the run ended first" in out
    assert re.search(r"run 1 with 0 DataLoader worker\(s\): started fresh", out)
    assert re.search(r"run 2 with 2 DataLoader worker\(s\): resumed from .*first step [\d.]+ s after its start", out)


def test_a_dataset_that_depends_on_its_worker_is_caught_when_the_resume_changes_the_workers(correct, tmp_path):
    status, out, saved = _check(tmp_path, "--reference", correct[2], "--workers", "0,2", "--at", "3", bug="workers")
    assert status == 1, out
    assert f"DIFFERENT samples from step {saved + 1} (rank 0; after kill 1: SIGKILL at step" in out
    assert re.search(r"came     batch 1 of the step: \[\d{3}, ", out)  # ids shifted by the worker that read them


def test_a_loader_that_drops_a_batch_at_a_resume_is_caught_at_the_first_step_after_the_checkpoint(correct, tmp_path):
    status, out, saved = _check(tmp_path, "--reference", correct[2], "--at", "3", bug="drop")
    assert status == 1, out
    assert f"DIFFERENT samples from step {saved + 1} (rank 0; after kill 1: SIGKILL at step" in out
    assert re.search(r"expected batch 1 of the step: \[[\d, ]+\] \(digest \w+\)\n  came     batch 1", out)


def test_weights_changed_at_a_resume_are_caught_though_the_samples_are_identical(correct, tmp_path):
    status, out, saved = _check(tmp_path, "--reference", correct[2], "--at", "3", "--signal", "TERM", bug="perturb")
    assert status == 1, out
    assert f"identical samples, weights differ from step {saved + 1} (rank 0; after kill 1: SIGTERM" in out
    assert re.search(r"expected loss [\d.]+\n  came     loss [\d.]+\n  expected parameters after the step: digest", out)


def test_kills_at_named_moments_are_made_where_the_uninterrupted_run_had_them_and_an_absent_one_is_reported(
        correct, tmp_path):
    status, out, _ = _check(tmp_path, "--reference", correct[2], "--at", "save,epoch-end,eval")
    assert status == 0, out
    assert "the kill at eval cannot be made: the uninterrupted run never reached that moment" in out
    assert ("run 1: started fresh, first step" in out and "; killed at save (inside the save after step 2, its model "
            "files written) (SIGKILL sent once it had recorded step 2)" in out)
    # The save was cut after Accelerate's files: that checkpoint is incomplete, so the next run starts afresh.
    assert re.search(r"run 2: started fresh \(no complete checkpoint to resume from\).*; killed at epoch-end "
                     r"\(step 4\) \(SIGKILL sent once it had recorded step 4\)", out)
    assert "identical: every batch, loss and weight of the 8 steps on 1 rank(s), 2 kill(s)" in out


def _step(n: int, batch: str, params: str = "p") -> dict:
    return {"event": "step", "step": n, "batches": [[batch, ""]], "losses": [0.5], "params": params}


def test_stitching_replaces_the_steps_a_killed_run_made_after_its_checkpoint():
    killed = {0: [_step(1, "a"), _step(2, "b"), _step(3, "x")]}  # killed after step 3, saved after step 2
    resumed = {0: [{"event": "resumed", "step": 2}, _step(3, "c"), _step(4, "d")]}
    reference = stitch([{0: [_step(1, "a"), _step(2, "b"), _step(3, "c"), _step(4, "d")]}])
    assert compare(reference, stitch([killed, resumed])).kind == "identical"
    verdict = compare(reference, stitch([killed, {0: resumed[0][:2]}]))
    assert (verdict.kind, verdict.step, verdict.run, verdict.came) == (
        "samples", 4, 1, ["no such step: the run ended before it"])


def test_a_record_line_cut_by_a_kill_is_read_as_nothing(tmp_path):
    (tmp_path / "rank0.jsonl").write_text('{"event": "start"}\n{"event": "step", "st\n{"event": "start"}\n{"eve')
    assert RecordFiles(tmp_path).take() == {0: [{"event": "start"}, {"event": "start"}]}


def test_recording_is_off_unless_the_checker_asks(monkeypatch, tmp_path):
    from accelerate_stateful import Accelerator

    monkeypatch.setattr(_record_switch, "active", None)  # put back after the test, whatever it leaves
    monkeypatch.delenv(_record_switch.RECORD_ENV, raising=False)
    Accelerator(cpu=True)
    assert _record_switch.active is None
    monkeypatch.setenv(_record_switch.RECORD_ENV, str(tmp_path))
    Accelerator(cpu=True)
    assert _record_switch.active is not None and (tmp_path / "rank0.jsonl").exists()
    monkeypatch.delenv(_record_switch.RECORD_ENV)
    Accelerator(cpu=True)
    assert _record_switch.active is None


def test_the_checkers_worker_count_replaces_a_prepared_loaders_own_and_leaves_the_users_loader_alone(monkeypatch):
    import torch
    from accelerate.utils import DataLoaderConfiguration
    from torch.utils.data import DataLoader

    from accelerate_stateful import Accelerator
    from accelerate_stateful.training._check_workers import with_checker_workers

    monkeypatch.setattr(_record_switch, "active", None)
    mine = DataLoader(torch.arange(8), batch_size=2, num_workers=2, prefetch_factor=3, persistent_workers=True)
    monkeypatch.setenv(_record_switch.WORKERS_ENV, "0")
    prepared = with_checker_workers(mine)
    assert (prepared.num_workers, prepared.prefetch_factor, prepared.persistent_workers) == (0, None, False)
    assert [b.tolist() for b in prepared] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert (mine.num_workers, mine.prefetch_factor, mine.persistent_workers) == (2, 3, True)
    monkeypatch.setenv(_record_switch.WORKERS_ENV, "2")
    stateful = DataLoaderConfiguration(use_stateful_dataloader=True)
    assert Accelerator(cpu=True, dataloader_config=stateful).prepare(DataLoader(torch.arange(8))).num_workers == 2


@pytest.mark.parametrize("value", ["two", "-1", "1.5"])
def test_a_worker_count_that_is_not_a_whole_number_is_refused_naming_the_variable(monkeypatch, value):
    from accelerate_stateful.errors import UnsupportedConfigError
    from accelerate_stateful.training._check_workers import workers_override

    monkeypatch.setenv(_record_switch.WORKERS_ENV, value)
    with pytest.raises(UnsupportedConfigError, match=f"ACCELERATE_STATEFUL_NUM_WORKERS='{re.escape(value)}' is not a "
                                                      "DataLoader worker count: give a whole number, 0 or more"):
        workers_override()


LAUNCHER = """
import subprocess, sys, time
rank = "import sys, time\\nopen(sys.argv[1], 'w').close()\\ntime.sleep(120)"
subprocess.Popen([sys.executable, "-c", rank, sys.argv[1]], start_new_session=True)  # as torchrun starts a rank
time.sleep(120)
"""


def test_a_runs_end_kills_the_ranks_its_launcher_started_in_sessions_of_their_own(tmp_path):
    """torchrun (accelerate launch --multi_gpu) starts each rank in a session of its own: ending the launcher's
    group alone left the ranks training, writing records and checkpoints while the checker's next run started."""
    import os
    import subprocess
    import time

    from accelerate_stateful.cli._jobtree import Job, _stats

    ready = tmp_path / "rank_started"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(ready)], start_new_session=True)
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.exists()
    job = Job(launcher)
    job.look()
    ranks = [pid for pid, parent, _ in _stats() if parent == launcher.pid]
    assert len(ranks) == 1 and os.getpgid(ranks[0]) != launcher.pid
    job.end()
    assert ranks[0] not in {pid for pid, _, _ in _stats()}, "the rank outlived the run's end"


def test_the_lm_pipeline_example_resumed_on_other_workers_is_identical(tmp_path):
    """examples/lm_pipeline.py (a Mixture of a datasets stream, a map-style and an iterable source, packed into
    rows; gradient accumulation, an evaluation and a save every few steps), killed after an evaluation and a save
    on 0 workers and resumed on 2: every step's rows, losses and weights are the uninterrupted run's (the batches
    of a composable source do not depend on the workers). docs/check-resume.md has the 10-kill chain across
    processes too."""
    example = Path(__file__).resolve().parent.parent / "examples" / "lm_pipeline.py"
    done = run_subprocess([sys.executable, "-m", "accelerate_stateful", "check-resume", "--runs", tmp_path,
                           "--workers", "0,2", "--at", "first-batch,7", "--", sys.executable, example], timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert re.search(r"run 2 with 2 DataLoader worker\(s\): resumed from checkpoint_\d+ \(saved after step 6\)", out)
    assert "identical: every batch, loss and weight of the 18 steps on 1 rank(s), 2 kill(s)" in out


def test_a_relative_script_path_the_runs_would_not_find_is_refused_before_any_run_with_its_absolute_path(tmp_path):
    # Each run starts in a fresh folder of its own: "python train.py" there failed with only "can't open file"
    # in the run's log. It is refused at once, in the user's terms; with --workdir . it is found and allowed on.
    (tmp_path / "train.py").write_text("raise SystemExit(3)\n")
    refused = run_subprocess([sys.executable, "-m", "accelerate_stateful", "check-resume", "--runs", tmp_path / "runs",
                              "--", sys.executable, "train.py"], timeout=120, cwd=tmp_path)
    out = refused.stdout + refused.stderr
    assert refused.returncode == 2, out
    assert "train.py is a relative path" in out and str(tmp_path / "train.py") in out and "--workdir ." in out
    assert not (tmp_path / "runs" / "uninterrupted").exists()
    copied = run_subprocess([sys.executable, "-m", "accelerate_stateful", "check-resume", "--runs", tmp_path / "runs2",
                             "--workdir", ".", "--", sys.executable, "train.py"], timeout=120, cwd=tmp_path)
    assert "is a relative path" not in copied.stdout + copied.stderr
    assert "the uninterrupted run" in copied.stdout + copied.stderr  # it ran, and its exit status 3 is reported
