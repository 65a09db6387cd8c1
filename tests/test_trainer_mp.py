"""Trainer, TRL and a hand-written loop, killed and resumed in real processes (gloo, ``accelerate launch``).

``trainer_scenarios.py`` holds the scenarios; each launch is the same command, repeated until every
scenario ran to its end. Every rank's sample stream and the loss log of the killed-and-resumed run must
equal the uninterrupted run's: any lost, repeated or reordered sample fails. Coverage across the
scenarios (all pairs, not the product): map-style, a torch stream, ``datasets.Dataset`` and
``IterableDataset``, TRL's ``SFTTrainer`` on a tiny Llama; ``group_by_length``; gradient accumulation 1, 2
and 4; workers 0 and 2; ``max_steps`` and ``num_train_epochs``; a resume in a later epoch and in a later
pass of a stream; 1 and 2 processes and a resume on 1 process of a 2-process checkpoint; interrupted by
SIGKILL, by SIGKILL inside a save, by SIGTERM to the launcher and by SIGUSR1 to one rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import mp_harness
from trainer_scenarios import SETS

SCRIPT = Path(__file__).with_name("trainer_scenarios.py")
EXIT_PREEMPTED = 143


def _command(world: int, out: Path, set_name: str) -> list[str]:
    return mp_harness.accelerate_command(SCRIPT, [out, set_name], world)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _stitched(sdir: Path, rank: int, key: str) -> tuple[list[dict], list[list[dict]]]:
    """What the killed-and-resumed run trained on: each attempt from its start step, later attempts win."""
    attempts = [_records(sdir / f"attempt{a}.rank{rank}.jsonl")
                for a in range(len(list(sdir.glob(f"attempt*.rank{rank}.jsonl"))))]
    stitched: list[dict] = []
    for records in attempts:
        start = records[0]["start"]
        stitched = [r for r in stitched if r["step"] < start] + [r for r in records if key in r]
    return stitched, attempts


def _check_scenario(cfg: dict, sdir: Path, world: int) -> list[str]:
    problems = []
    for rank in range(world):
        reference = [r for r in _records(sdir / f"reference.rank{rank}.jsonl") if "ids" in r]
        stitched, attempts = _stitched(sdir, rank, "ids")
        if [(r["step"], r["ids"]) for r in stitched] != [(r["step"], r["ids"]) for r in reference]:
            problems.append(f"{cfg['sid']} rank {rank}: the resumed sample stream differs from the uninterrupted "
                            f"one:\n  resumed  {[r['ids'] for r in stitched]}\n  expected {[r['ids'] for r in reference]}")
        ref_result = json.loads((sdir / f"reference.rank{rank}.json").read_text())
        result = json.loads((sdir / f"result.rank{rank}.json").read_text())
        if cfg["data"] == "loop":
            losses = [(r["step"], r["loss"]) for r in _stitched(sdir, rank, "loss")[0]]
            expected = [(r["step"], r["loss"]) for r in _records(sdir / f"reference.rank{rank}.jsonl") if "loss" in r]
        else:
            losses, expected = [tuple(x) for x in result["losses"]], [tuple(x) for x in ref_result["losses"]]
        if losses != expected:
            problems.append(f"{cfg['sid']} rank {rank}: loss log {losses} != uninterrupted {expected}")
        if result["global_step"] != ref_result["global_step"] or result.get("lr") != ref_result.get("lr"):
            problems.append(f"{cfg['sid']} rank {rank}: ended at {result}, the uninterrupted run at {ref_result}")
        problems += _check_interruption(cfg, attempts, rank)
    return problems


def _check_interruption(cfg: dict, attempts: list[list[dict]], rank: int) -> list[str]:
    kind, step = cfg["stop"]
    save_steps, resumed_at = cfg["save_steps"], attempts[1][0]["start"] if len(attempts) > 1 else None
    where = f"{cfg['sid']} rank {rank} ({kind} after step {step})"
    if len(attempts) != 2:
        return [f"{where}: expected one interrupted attempt and one resumed, found {len(attempts)} attempts"]
    exits = [r["exit"] for r in attempts[0] if "exit" in r]
    if kind in ("term", "usr1"):
        if exits != [EXIT_PREEMPTED]:
            return [f"{where}: the preempted attempt recorded exits {exits}, expected [{EXIT_PREEMPTED}]"]
        # The signal goes out after step `step`; the checkpoint is taken at the first boundary that sees it.
        if not step <= resumed_at <= step + 3:
            return [f"{where}: resumed from checkpoint-{resumed_at}, not from the preemption checkpoint after {step}"]
        return []
    expected = (step // save_steps) * save_steps if kind == "kill" else step - save_steps
    if exits or resumed_at != expected:
        return [f"{where}: resumed from checkpoint-{resumed_at} (exits {exits}), expected the newest complete "
                f"checkpoint-{expected}"]
    return []


def _check_elastic(cfg: dict, root: Path) -> list[str]:
    """A 2-process checkpoint resumed on 1 process: the epoch's rest comes once, the counters stay consistent."""
    source = next(c for c in SETS["world2"] if c["sid"] == cfg["source"])
    sdir, at = root / cfg["sid"], cfg["checkpoint"]
    per_epoch = source["n"] // (2 * source["bs"] * source["ga"])
    epoch_start = (at // per_epoch) * per_epoch
    before = [i for rank in range(2) for r in _records(root / cfg["source"] / f"reference.rank{rank}.jsonl")
              if "ids" in r and epoch_start <= r["step"] < at for i in r["ids"]]
    after = [i for r in _records(sdir / "attempt0.rank0.jsonl") if "ids" in r for i in r["ids"]]
    problems = []
    if sorted(before + after) != list(range(source["n"])):
        problems.append(f"elastic: epoch {at // per_epoch} had {sorted(before)} before the save and {after} after "
                        "the resume on 1 process; expected every sample exactly once")
    result = json.loads((sdir / "result.rank0.json").read_text())
    rest_steps = -(-len(after) // source["bs"]) // source["ga"]
    if (result["global_step"], result["epoch"], result["max_steps"], result["lr"]) != (at + rest_steps, 2.0,
                                                                                       at + rest_steps, 0.0):
        problems.append(f"elastic: ended at {result}; expected global_step = max_steps = {at + rest_steps}, "
                        "epoch 2.0 and the linear schedule at 0")
    return problems


@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
def test_trainer_runs_killed_and_resumed_continue_every_rank_exactly(tmp_path):
    root = tmp_path / "runs"
    root.mkdir()
    problems = []
    for world, set_name in ((2, "world2"), (1, "world1")):
        interruptions = sum(1 for cfg in SETS[set_name] if "stop" in cfg)
        for launch in range(interruptions + 1):  # each launch runs the scenarios its predecessors left
            done = mp_harness.launch(_command(world, root, set_name), tmp_path / f"{set_name}.launch{launch}",
                                     timeout_s=400, watch=[root], HF_HOME=str(tmp_path / "hf_home"))
            finished = all((root / f"{set_name}.finished.rank{r}").exists() for r in range(world))
            if done.hung or finished != (launch == interruptions) or done.ok != finished:
                pytest.fail(f"{set_name} launch {launch}: finished={finished}; expected the launch to end "
                            f"{'normally' if launch == interruptions else 'interrupted'}:\n{done.report()}")
        for cfg in SETS[set_name]:
            if cfg["data"] == "elastic":
                problems += _check_elastic(cfg, root)
            elif "stop" in cfg:
                problems += _check_scenario(cfg, root / cfg["sid"], world)
    assert not problems, "\n".join(problems)
