"""The demo's verifiers, on synthetic streams, and the demo itself, end to end (kill, restart, compare)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
DEMO_PATH = EXAMPLES / "demo.py"
sys.path.insert(0, str(EXAMPLES))
import _elastic  # noqa: E402
import _verify  # noqa: E402
from _elastic import Batch  # noqa: E402

SAMPLES, BATCH, WORLD, EPOCHS = 20, 3, 2, 2
STEPS_PER_EPOCH = -(-SAMPLES // (BATCH * WORLD))


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
    verdict = _verify.verify(runs / "reference", runs / "interrupted", ["checkpoint_1"])

    assert verdict.ok, [r.problems for r in verdict.ranks] + verdict.epoch_problems
    assert [(r.checkpoint, r.step, r.replayed) for r in verdict.ranks[0].resumes] == [("checkpoint_1", 4, 2)]
    assert len(verdict.ranks[1].effective) == EPOCHS * STEPS_PER_EPOCH


def test_self_check_sees_the_verifier_reject_every_damaged_stream(runs: Path):
    outcomes = _verify.self_check(runs / "reference", runs / "interrupted", runs / "self_check")

    assert outcomes == {name: _verify.REJECTED for name in _verify.PERTURBATIONS}


def test_verifier_rejects_a_resume_that_continues_one_batch_late(tmp_path: Path):
    total = EPOCHS * STEPS_PER_EPOCH
    write_run(tmp_path / "reference", [(0, total, None)])
    write_run(tmp_path / "interrupted", [(0, 4, None), (4, total, "checkpoint_1")], shift=1)

    verdict = _verify.verify(tmp_path / "reference", tmp_path / "interrupted")

    assert not verdict.ok
    assert "first difference from the reference at step 5: ids" in verdict.ranks[0].problems[0]


def test_verifier_rejects_a_restart_from_an_older_checkpoint_than_the_newest(runs: Path):
    verdict = _verify.verify(runs / "reference", runs / "interrupted", ["checkpoint_2"])

    assert verdict.ranks[0].problems == [
        "restart 1 loaded checkpoint_1, but the newest complete checkpoint was checkpoint_2"
    ]


# --------------------------------------------------------------------------- elastic: 2 processes, then 3
N, NEW_WORLD, LAST_EPOCH = 23, 3, 2  # epochs 0..2; the checkpoint is 2 steps into epoch 1
OLD_STEPS = -(-N // (BATCH * WORLD))  # 4 steps of 6 samples per epoch on 2 ranks
CONSUMED = 2 * BATCH * WORLD  # 12 of epoch 1's 23 samples taken before the checkpoint
CHECKPOINT = _elastic.Checkpoint("checkpoint_1", epoch=1, consumed=CONSUMED, world=WORLD, workers=2, num_samples=N)
TOPOLOGY_LOG = ("[accelerate_stateful._lines] WARNING: [RANK 0] accelerate-stateful: loader 0: resuming epoch 1 at "
                "52.2% on 3 ranks x 1 "
                "workers (was 2 x 2) from runs/checkpoints/checkpoint_1")


def stripe(epoch: int, world: int, rank: int, origin: int = 0, *, pad_from_start: bool = True,
           seed: int = 0) -> list[Batch]:
    """Rank ``rank``'s batches of ``epoch`` from position ``origin``, striped as Accelerate does with even_batches.

    With ``pad_from_start=False`` the last step is padded from the epoch's end instead: a wrong padding.
    """
    order = random.Random(epoch + seed).sample(range(N), N)
    total = world * BATCH
    batches = []
    for step in range(-(-(N - origin) // total)):
        start = origin + step * total + rank * BATCH
        positions = [p if p < N else (p - N if pad_from_start else 2 * N - 1 - p) for p in range(start, start + BATCH)]
        batches.append(Batch(epoch, step, [order[p] for p in positions]))
    return batches


def elastic_chain(origin: int = CONSUMED, **broken) -> tuple[list[list[_verify.Attempt]], _elastic.Simulation]:
    """Streams of a run killed one step after the checkpoint on 2 ranks and resumed on 3 from ``origin``.

    The simulation agrees with the streams, so a broken resume (``origin``, ``broken``) is one that the
    simulation shares: only the verifier's own checks of the promise can catch it.
    """
    old = [stripe(0, WORLD, r) + stripe(1, WORLD, r)[:3] for r in range(WORLD)]  # 7 steps; the checkpoint at 6
    new = [stripe(1, NEW_WORLD, r, origin, **broken) + stripe(2, NEW_WORLD, r) for r in range(NEW_WORLD)]
    streams = []
    for rank in range(NEW_WORLD):
        attempts = []
        if rank < WORLD:
            attempts.append(attempt(0, rank, WORLD, None, 0, old[rank]))
        attempts.append(attempt(len(attempts), rank, NEW_WORLD, "checkpoint_1", OLD_STEPS + 2, new[rank]))
        streams.append(attempts)
    fresh = [stripe(2, NEW_WORLD, r) for r in range(NEW_WORLD)]
    padding = -(N - CONSUMED) % (NEW_WORLD * BATCH)
    return streams, _elastic.Simulation([b[: OLD_STEPS + 2] for b in old], new, fresh, padding)


def attempt(number: int, rank: int, world: int, checkpoint: Optional[str], step: int, batches: list[Batch]
            ) -> _verify.Attempt:
    start = {"event": "start", "attempt": number, "rank": rank, "world_size": world, "resumed_from": checkpoint,
             "step": step, "epoch": batches[0].epoch, "batch": batches[0].batch, "dataset_size": N}
    lines = [{"event": "batch", "attempt": number, "rank": rank, "step": step + k + 1, "epoch": b.epoch,
              "batch": b.batch, "ids": b.ids, "loss": 0.5} for k, b in enumerate(batches)]
    return _verify.Attempt(start, lines)


def test_elastic_verifier_accepts_the_rest_of_the_epoch_delivered_once_with_the_epochs_first_as_padding():
    streams, sim = elastic_chain()

    verdict = _elastic.verify_elastic(streams, CHECKPOINT, sim, TOPOLOGY_LOG)

    assert verdict.ok, verdict.problems
    assert sim.padding == 7  # 11 samples left, 2 steps of 9 on 3 ranks
    epoch_order = random.Random(1).sample(range(N), N)
    assert f"none came back except 7 of end-of-epoch padding {epoch_order[:7]}" in verdict.lines[3]
    assert verdict.lines[0].startswith("rank 0: 6 batches up to checkpoint_1 on 2 processes (+1 trained after it")
    assert verdict.lines[2].startswith("rank 2: 0 batches up to checkpoint_1 on 2 processes, 5 after it on 3")


@pytest.mark.parametrize("broken,problem", [
    pytest.param({"origin": CONSUMED - BATCH * WORLD}, "samples consumed before checkpoint_1 delivered again",
                 id="resumed-one-step-early"),
    pytest.param({"origin": CONSUMED + 2}, "samples never delivered", id="resumed-two-samples-late"),
    pytest.param({"pad_from_start": False}, "end-of-epoch padding", id="padded-from-the-epochs-end"),
    pytest.param({"seed": 7}, "samples consumed before checkpoint_1 delivered again", id="another-order"),
])
def test_elastic_verifier_rejects_a_broken_resume_even_when_the_simulation_shares_the_bug(broken, problem):
    streams, sim = elastic_chain(**broken)

    verdict = _elastic.verify_elastic(streams, CHECKPOINT, sim, TOPOLOGY_LOG)

    assert not verdict.ok
    assert problem in verdict.problems[0]


def test_elastic_verifier_rejects_a_later_epoch_that_is_not_a_fresh_runs():
    streams, sim = elastic_chain()
    sim.fresh = [stripe(2, NEW_WORLD, r, seed=1) for r in range(NEW_WORLD)]

    verdict = _elastic.verify_elastic(streams, CHECKPOINT, sim, TOPOLOGY_LOG)

    assert verdict.problems == ["epoch 2: ranks [0, 1, 2] differ from a fresh 3-process run's batches; 23/23 samples"]


def test_elastic_verifier_rejects_batches_that_differ_from_the_simulation():
    streams, sim = elastic_chain()
    sim.new[2][0] = Batch(1, 0, list(reversed(sim.new[2][0].ids)))

    verdict = _elastic.verify_elastic(streams, CHECKPOINT, sim, TOPOLOGY_LOG)

    assert [p.split(",")[0] for p in verdict.problems] == ["rank 2 differs from the simulation after the checkpoint"]


@pytest.mark.parametrize("log", [
    pytest.param("", id="no-warning"),
    pytest.param(TOPOLOGY_LOG.replace("was 2 x 2", "was 2 x 0"), id="wrong-saved-workers"),
    pytest.param(TOPOLOGY_LOG.replace("epoch 1", "epoch 2"), id="wrong-epoch"),
])
def test_elastic_verifier_requires_the_packages_warning_about_the_new_topology(log):
    streams, sim = elastic_chain()

    verdict = _elastic.verify_elastic(streams, CHECKPOINT, sim, log)

    logged = log.strip() or None
    assert verdict.problems == [
        f"the resumed run did not log 'resuming epoch 1 ... on 3 ranks ... (was 2 x 2)'; it logged {logged!r}"
    ]


def test_elastic_self_check_sees_the_verifier_reject_every_damaged_stream():
    streams, sim = elastic_chain()

    outcomes = _elastic.self_check(streams, CHECKPOINT, sim, TOPOLOGY_LOG)

    assert outcomes == {name: _verify.REJECTED for name in _elastic.PERTURBATIONS}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_demo_kills_a_two_process_run_twice_and_it_resumes_identically_and_on_three(tmp_path: Path):
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
    assert "ELASTIC OK" in output
    assert "WARNING: [RANK 0] accelerate-stateful: loader 0: resuming epoch 0 at" in output  # the package's line about the new topology
    assert "NOT DETECTED" not in output
