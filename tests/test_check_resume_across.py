"""``check-resume --processes``: the command's process count rewritten, and a chain on other process counts
compared all ranks together (``cli/_check_setup.py``, ``cli/_across.py``); no process is started here."""

from __future__ import annotations

import pytest

from accelerate_stateful.cli._across import compare_across, stitch_across
from accelerate_stateful.cli._check_setup import Setup, with_processes

LAUNCH = ["env", "ACCELERATE_USE_CPU=1", "/venv/bin/accelerate", "launch", "--multi_gpu"]


@pytest.mark.parametrize("command, expected", [
    (LAUNCH + ["--num_processes", "2", "train.py", "--num_processes", "9"],
     LAUNCH + ["--num_processes", "3", "train.py", "--num_processes", "9"]),
    (LAUNCH + ["--num-processes=2", "train.py"], LAUNCH + ["--num-processes=3", "train.py"]),
    (["torchrun", "--nproc_per_node", "2", "train.py"], ["torchrun", "--nproc_per_node", "3", "train.py"]),
    (["torchrun", "--nproc-per-node=2", "train.py"], ["torchrun", "--nproc-per-node=3", "train.py"]),
])
def test_the_launchers_process_count_is_rewritten_and_the_scripts_own_arguments_are_left_alone(command, expected):
    assert with_processes(command, 3) == expected


def test_a_command_that_no_launcher_starts_is_refused_naming_both_launchers():
    with pytest.raises(ValueError, match=r"'accelerate launch --num_processes N \.\.\.' or 'torchrun --nproc_per_node"):
        with_processes(["python", "train.py"], 2)
    with pytest.raises(ValueError, match="the command's accelerate has no --num_processes N to change: write it out"):
        with_processes(["accelerate", "launch", "train.py"], 2)


def test_runs_cycle_through_the_process_and_worker_counts():
    setup = Setup(["torchrun", "--nproc_per_node", "1", "t.py"], workers=[0, 2], processes=[2, 3, 2])
    variants = [setup.variant(k) for k in (1, 2, 3, 4)]
    assert [v.command[2] for v in variants] == ["2", "3", "2", "2"]
    assert [v.env["ACCELERATE_STATEFUL_NUM_WORKERS"] for v in variants] == ["0", "2", "0", "2"]
    assert variants[1].label == "3 process(es) and 2 DataLoader worker(s)"


def _run(steps: dict[int, list[list[str]]], loss: float = 1.0, norm: float = 2.0, first: int = 1) -> dict:
    """One run's records: step -> each rank's samples (one batch per rank), from step ``first``."""
    lines: dict[int, list] = {}
    for step, ranks in steps.items():
        if step < first:
            continue
        for rank, samples in enumerate(ranks):
            lines.setdefault(rank, []).append({"event": "step", "step": step, "batches": [["d", "", samples]],
                                               "losses": [loss], "norm": norm})
    return lines


REFERENCE = {1: [["a", "c"], ["b", "d"]], 2: [["e", "g"], ["f", "h"]], 3: [["i", "k"], ["j", "l"]]}
ON_THREE = {2: [["e", "h"], ["f", "g"], []], 3: [["i", "l"], ["j"], ["k"]]}


def test_a_chain_resumed_on_three_processes_is_identical_in_samples_and_equal_within_the_tolerance():
    ref = stitch_across([_run(REFERENCE)])
    killed = _run({**REFERENCE, 3: [["x", "y"], ["z", "w"]]})  # its step 3 is replaced by the resumed run's
    verdict = compare_across(ref, stitch_across([killed, _run(ON_THREE, loss=1.0 + 1e-7, first=2)]))
    assert (verdict.kind, verdict.steps) == ("identical", 3)
    assert "within a relative 0.0001 (not bitwise" in verdict.note


def test_a_sample_lost_at_a_resume_on_three_processes_is_caught_at_its_step():
    ref = stitch_across([_run(REFERENCE)])
    lost = {2: ON_THREE[2], 3: [["i", "l"], ["j"], []]}
    verdict = compare_across(ref, stitch_across([_run(REFERENCE), _run(lost, first=2)]))
    assert (verdict.kind, verdict.step, verdict.rank, verdict.run) == ("samples", 3, None, 1)
    assert "(1 sample(s) of the uninterrupted run missing so far, 0 not in it or repeated)" in verdict.came[0]


def test_weights_beyond_the_tolerance_are_caught_and_another_global_batch_compares_samples_only():
    ref = stitch_across([_run(REFERENCE)])
    verdict = compare_across(ref, stitch_across([_run(REFERENCE), _run(ON_THREE, norm=2.001, first=2)]))
    assert (verdict.kind, verdict.step) == ("weights", 2)
    assert verdict.came == ["parameters' norm after the step 2.001"]
    bigger = {1: [["a", "c", "e"], ["b", "d", "g"]], 2: [["f", "h", "i"], ["j", "k", "l"]]}
    verdict = compare_across(ref, stitch_across([_run(bigger)]))
    assert verdict.kind == "identical" and "loss and weights not compared: the global batch" in verdict.note
    assert verdict.note.startswith("compared over the first 12 samples, which both runs took")


def test_a_chain_of_a_larger_global_batch_and_the_same_steps_is_compared_where_the_uninterrupted_run_ends():
    """A fixed number of steps (the Trainer's max_steps) of a larger global batch takes samples past the
    uninterrupted run's last: those are not compared; a sample lost before that point still is."""
    ref = stitch_across([_run(REFERENCE)])
    longer = {2: [["e", "g", "i"], ["f", "h", "j"]], 3: [["k", "l", "m"], ["n", "o", "p"]]}
    verdict = compare_across(ref, stitch_across([_run(REFERENCE), _run(longer, first=2)]))
    assert verdict.kind == "identical" and verdict.note.startswith("compared over the first 12 samples")
    lost = {2: [["e", "g", "i"], ["f", "h", "x"]], 3: [["k", "l", "m"], ["n", "o", "p"]]}
    verdict = compare_across(ref, stitch_across([_run(REFERENCE), _run(lost, first=2)]))
    assert (verdict.kind, verdict.step) == ("samples", 3)
