"""A training run SIGKILLed at random micro-steps and restarted ends bitwise equal to the uninterrupted one.

``tests/bitwise_train.py`` trains three runs in one process: ``num_workers`` 0
and 2 over ``DataLoader(batch_size=..., shuffle=True)``, and ``num_workers=2``
over a user's own length-bucketing ``batch_sampler`` (``BatchSamplerDataLoader``,
whose workers seed each batch's fetch as the shard loader's do). Each has
dropout, AdamW, an LR schedule, ``gradient_accumulation_steps=2``,
``clip_grad_norm_`` and augmentation drawn from ``torch``, ``random`` and
``numpy`` in ``__getitem__``, saving every 3 micro-steps, so every other
checkpoint falls between the two micro-steps of a window. Per world size (1 and
2 real processes on gloo) one uninterrupted launch runs beside the killed one;
the killed one dies (SIGKILL, every rank) at micro-steps drawn from a seeded
RNG (two on one process, one on two: launches are slow), the first of them
after a checkpoint taken inside a window, and is restarted with the same
command each time. Then every micro-step's loss (as
``float.hex``), the sample ids, the final weights and the optimizer states
(``torch.equal``) must be those of the uninterrupted run, and every re-trained
micro-step must repeat exactly. ``BITWISE_SEED`` changes the kill plan
(default 0; printed).
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import mp_harness
from scripts import load_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "bitwise_train.py"
SEED = int(os.environ.get("BITWISE_SEED", "0"))
SAMPLES, BATCH, SAVE_EVERY, ACCUMULATION = 48, 4, 3, 2
EPOCHS = {1: 2, 2: 2}
KILLS = {1: 2, 2: 1}
LAUNCH_TIMEOUT_S = 180

demo = load_script("examples/demo.py", "examples_demo")


def kill_plan(world: int, seed: int) -> list[int]:
    """Micro-steps to die at: the first right after (or a little after) a checkpoint inside a window."""
    total = EPOCHS[world] * -(-SAMPLES // (BATCH * world))
    rng = random.Random(f"{seed}-{world}")
    inside = [s for s in range(SAVE_EVERY, total // 2)
              if (s // SAVE_EVERY * SAVE_EVERY) % ACCUMULATION != 0]  # the newest checkpoint is mid-window
    plan = [rng.choice(inside)]
    while len(plan) < KILLS[world]:
        plan.append(rng.randrange(plan[-1] + 1, total))
    return plan


def command(world: int, out: Path, plan: list[int]) -> list[str]:
    args = [str(SCRIPT), "--out", str(out), "--kill-plan", ",".join(map(str, plan)), "--samples", str(SAMPLES),
            "--batch-size", str(BATCH), "--epochs", str(EPOCHS[world]), "--save-every", str(SAVE_EVERY)]
    if world == 1:
        return [sys.executable, *args]
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(world),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(demo.free_port()), *args]


def finish(job: mp_harness.Job) -> mp_harness.Launch:
    return mp_harness.finish(job, timeout_s=LAUNCH_TIMEOUT_S, stall_s=0.75 * mp_harness.COLLECTIVE_TIMEOUT_S)


def records(path: Path) -> tuple[list[dict], dict[tuple[str, int], dict], list[str]]:
    """A rank's start records, its newest record per (run, micro-step), and re-trained steps that differ."""
    starts, newest, changed = [], {}, []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "start" in record:
            starts.append(record)
            continue
        key = (record["run"], record["step"])
        if key in newest and newest[key] != record:
            changed.append(f"{key}: {newest[key]} then {record}")
        newest[key] = record
    return starts, newest, changed


def differences(expected: Any, actual: Any, path: str = "") -> list[str]:
    """Where two trees of tensors differ (``torch.equal``: same shape, dtype and every bit of value)."""
    if isinstance(expected, torch.Tensor):
        same = isinstance(actual, torch.Tensor) and expected.dtype == actual.dtype and torch.equal(expected, actual)
        return [] if same else [path]
    if isinstance(expected, dict):
        if set(expected) != set(actual):
            return [f"{path}: keys {sorted(expected)} != {sorted(actual)}"]
        return [d for key in expected for d in differences(expected[key], actual[key], f"{path}/{key}")]
    if isinstance(expected, (list, tuple)):
        if len(expected) != len(actual):
            return [f"{path}: length {len(expected)} != {len(actual)}"]
        return [d for i, (e, a) in enumerate(zip(expected, actual)) for d in differences(e, a, f"{path}/{i}")]
    return [] if expected == actual else [f"{path}: {expected!r} != {actual!r}"]


@pytest.mark.multiprocess
@pytest.mark.timeout(4 * LAUNCH_TIMEOUT_S)
@pytest.mark.parametrize("world", [pytest.param(1, id="world1"), pytest.param(2, id="world2")])
def test_a_run_killed_between_micro_steps_ends_bitwise_equal_with_workers_and_a_batch_sampler(tmp_path, world):
    plan = kill_plan(world, SEED)
    print(f"world {world}, seed {SEED}: SIGKILL at micro-steps {plan}")
    reference, run = tmp_path / "reference", tmp_path / "run"
    ref_job = mp_harness.start(command(world, reference, []), tmp_path / "reference.launch")
    try:
        for attempt in range(len(plan)):
            done = finish(mp_harness.start(command(world, run, plan), tmp_path / f"attempt{attempt}"))
            assert not done.hung and done.returncode != 0 and (run / f"killed_at_{plan[attempt]}").exists(), (
                f"attempt {attempt} should have died at micro-step {plan[attempt]}:\n{done.report()}")
        done = finish(mp_harness.start(command(world, run, plan), tmp_path / "final"))
        assert done.ok, done.report()
        done = finish(ref_job)
        assert done.ok, done.report()
    finally:
        ref_job.kill()

    for rank in range(world):
        _, expected, _ = records(reference / f"log_rank{rank}.jsonl")
        starts, actual, changed = records(run / f"log_rank{rank}.jsonl")
        assert len(starts) == len(plan) + 1 and starts[1]["pending_gradients"], starts
        assert starts[0]["loaders"]["bs2"] == "BatchSamplerDataLoader", starts[0]
        assert not changed, changed
        assert sorted(actual) == sorted(expected)
        wrong = [f"{key}: {expected[key]} vs {actual[key]}" for key in sorted(expected) if actual[key] != expected[key]]
        assert not wrong, f"rank {rank}: {len(wrong)} micro-steps differ, first: {wrong[:3]}"
        final = torch.load(reference / f"final_rank{rank}.pt"), torch.load(run / f"final_rank{rank}.pt")
        assert set(final[0]) == {"w0", "w2", "bs2"}
        assert not differences(*final), f"rank {rank}: final states differ at {differences(*final)[:5]}"
