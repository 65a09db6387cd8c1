"""The demo's verifier: a killed-and-restarted run's batch streams against an uninterrupted run's.

``examples/train.py`` logs, on every rank, one JSON line per batch it trains
on, preceded by a start record per process start. :func:`verify` rebuilds the
interrupted run's effective stream (for a step trained twice, the copy from the
later process) and requires, on every rank, the same steps, epochs, sample ids
in the same order, batch boundaries and losses as the reference; the steps
re-trained after a resume must repeat exactly what the killed run had trained;
and every epoch must cover the dataset, with no sample repeated across ranks
beyond the reference's own end-of-epoch padding.

:func:`self_check` damages copies of the interrupted streams (two ids swapped,
a batch dropped, a replayed step changed) and requires :func:`verify` to reject
each one.
"""

from __future__ import annotations

import collections
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

# What must match between the reference and the resumed run, in the order a difference is reported.
FIELDS = ("step", "epoch", "batch", "ids", "loss")


class DemoError(Exception):
    """The demo could not run as planned (a launch failed, a kill point was never reached)."""


# --------------------------------------------------------------------------- reading streams
@dataclass
class Attempt:
    """One process start of a run: its start record and the batches it trained, in order."""

    start: dict
    batches: list[dict] = field(default_factory=list)


def read_stream(path: Path) -> list[Attempt]:
    """Split a rank's stream into attempts; a line cut short by a kill may only end an attempt."""
    attempts: list[Attempt] = []
    torn_at = None
    for number, line in enumerate(path.read_text("utf-8").splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            torn_at = number
            continue
        if record["event"] == "start":
            attempts.append(Attempt(record))
        elif not attempts:
            raise DemoError(f"{path}:{number}: a batch record before any start record")
        elif torn_at is not None:
            raise DemoError(f"{path}:{torn_at}: damaged line in the middle of attempt {len(attempts) - 1}")
        else:
            attempts[-1].batches.append(record)
        torn_at = None
    return attempts


def first_difference(want: dict, got: dict) -> Optional[str]:
    """The first of ``FIELDS`` where ``got`` differs from ``want``, said in words; None when they agree."""
    for name in FIELDS:
        if want.get(name) != got.get(name):
            return f"{name} {got.get(name)} instead of {want.get(name)}"
    return None


# --------------------------------------------------------------------------- verifying
@dataclass
class Resume:
    """A restart: what it loaded, where that put it, and how many steps it trained a second time."""

    attempt: int
    checkpoint: Optional[str]
    epoch: int
    batch: int
    step: int
    replayed: int = 0
    replay_mismatches: int = 0


@dataclass
class RankReport:
    """One rank's result: its effective stream and everything found wrong with it."""

    rank: int
    effective: list[dict]
    attempts: int
    resumes: list[Resume]
    problems: list[str]


def effective_stream(attempts: list[Attempt], problems: list[str]) -> tuple[list[dict], list[Resume]]:
    """The batches that count: for a step trained more than once, the later process's copy.

    Also checks that each attempt starts right after the step it restored and
    that a re-trained step repeats exactly what the killed process trained.
    """
    by_step: dict[int, dict] = {}
    resumes = []
    for index, attempt in enumerate(attempts):
        start = attempt.start
        resume = Resume(index, start["resumed_from"], start["epoch"], start["batch"], start["step"])
        if index:
            resumes.append(resume)
        previous = start["step"]
        for line in attempt.batches:
            if line["step"] != previous + 1:
                problems.append(f"attempt {index} goes from step {previous} to step {line['step']}")
            previous = line["step"]
            if line["step"] in by_step:
                resume.replayed += 1
                diff = first_difference(by_step[line["step"]], line)
                if diff:
                    resume.replay_mismatches += 1
                    problems.append(f"step {line['step']} re-trained after resume {index} differs from the "
                                    f"killed run: {diff}")
            by_step[line["step"]] = line
    return [by_step[step] for step in sorted(by_step)], resumes


def verify_rank(
    rank: int, reference: list[Attempt], interrupted: list[Attempt], expected: Optional[list[Optional[str]]]
) -> RankReport:
    """Compare one rank's interrupted run with its reference; ``expected`` as in :func:`verify`."""
    problems: list[str] = []
    if len(reference) != 1:
        problems.append(f"the reference run has {len(reference)} process starts; it must run once, uninterrupted")
    want, _ = effective_stream(reference, problems)
    got, resumes = effective_stream(interrupted, problems)
    if expected is not None:
        problems += resume_problems(resumes, expected)
    for reference_line, line in zip(want, got):
        diff = first_difference(reference_line, line)
        if diff:
            problems.append(f"first difference from the reference at step {reference_line['step']}: {diff}")
            break
    if len(want) != len(got):
        problems.append(f"the reference trained {len(want)} steps, the interrupted run {len(got)}")
    return RankReport(rank, got, len(interrupted), resumes, problems)


def resume_problems(resumes: list[Resume], expected: list[Optional[str]]) -> list[str]:
    """Each restart must load the newest checkpoint that was complete when the job was killed."""
    if len(resumes) != len(expected):
        return [f"{len(resumes)} restarts logged, {len(expected)} kills made"]
    return [
        f"restart {resume.attempt} loaded {resume.checkpoint}, but the newest complete checkpoint was {newest}"
        for resume, newest in zip(resumes, expected)
        if resume.checkpoint != newest
    ]


def epoch_ids(streams: list[list[dict]]) -> dict[int, list[int]]:
    """Every sample id trained in each epoch, all ranks together."""
    ids: dict[int, list[int]] = collections.defaultdict(list)
    for stream in streams:
        for line in stream:
            ids[line["epoch"]].extend(line["ids"])
    return ids


def check_epochs(reference: list[list[dict]], interrupted: list[list[dict]], size: int) -> tuple[list[str], list[str]]:
    """Each epoch covers the dataset; repeats across ranks are only the reference's own padding."""
    notes, problems = [], []
    want_ids, got_ids = epoch_ids(reference), epoch_ids(interrupted)
    for epoch in sorted(set(want_ids) | set(got_ids)):
        want, got = _repeats(want_ids[epoch]), _repeats(got_ids[epoch])
        missing = set(range(size)) - set(got_ids[epoch])
        if missing:
            problems.append(f"epoch {epoch}: {len(missing)} samples never trained, e.g. {sorted(missing)[:5]}")
        if got != want:
            problems.append(f"epoch {epoch}: samples trained more than once across ranks {dict(got)}, in the "
                            f"reference {dict(want)}")
        else:
            notes.append(f"epoch {epoch}: {size - len(missing)}/{size} samples, {sum(got.values())} trained twice "
                         "across ranks, exactly the reference's end-of-epoch padding")
    return notes, problems


def _repeats(ids: list[int]) -> collections.Counter:
    """How many extra times each id occurs."""
    counts = collections.Counter(ids)
    return counts - collections.Counter(counts.keys())


@dataclass
class Verdict:
    """The whole comparison: a report per rank and the epoch coverage across ranks."""

    ranks: list[RankReport]
    epoch_notes: list[str]
    epoch_problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.epoch_problems and not any(r.problems for r in self.ranks)


def verify(
    reference_dir: Path, interrupted_dir: Path, expected_checkpoints: Optional[list[Optional[str]]] = None
) -> Verdict:
    """Compare the interrupted run's streams with the reference's, rank by rank and epoch by epoch.

    Args:
        reference_dir: Output folder of the uninterrupted run.
        interrupted_dir: Output folder of the run that was killed and restarted.
        expected_checkpoints: For each kill, the name of the newest complete
            checkpoint at that moment (what the restart must load); not checked when None.
    """
    paths = sorted(reference_dir.glob("stream_rank*.jsonl"))
    if not paths:
        raise DemoError(f"no stream_rank*.jsonl under {reference_dir}")
    reports, reference = [], []
    for rank, path in enumerate(paths):
        ref = read_stream(path)
        other = interrupted_dir / path.name
        run = read_stream(other) if other.exists() else []
        reports.append(verify_rank(rank, ref, run, expected_checkpoints))
        reference.append(effective_stream(ref, [])[0])
        size = ref[0].start["dataset_size"]
    notes, problems = check_epochs(reference, [r.effective for r in reports], size)
    return Verdict(reports, notes, problems)


def print_verdict(verdict: Verdict) -> None:
    for report in verdict.ranks:
        steps = len(report.effective)
        print(f"  rank {report.rank}: {steps} steps over {report.attempts} process starts "
              f"({len(report.resumes)} kills)")
        for resume in report.resumes:
            where = resume.checkpoint or "nothing (fresh start)"
            replayed = f"{resume.replayed} step{'s' * (resume.replayed != 1)} re-trained"
            same = (f"{resume.replay_mismatches} DIFFERENT from" if resume.replay_mismatches else "identical to")
            print(f"    resume {resume.attempt}: from {where} at epoch {resume.epoch}, batch {resume.batch} "
                  f"(step {resume.step}); {replayed}, {same} what the killed run trained")
        print("    " + ("; ".join(report.problems) if report.problems else
                        "stream vs reference: IDENTICAL (steps, epochs, sample ids and order, batches, losses)"))
    for note in verdict.epoch_notes:
        print(f"  {note}")
    for problem in verdict.epoch_problems:
        print(f"  PROBLEM {problem}")


# --------------------------------------------------------------------------- self-check
def _last_attempt_start(records: list[dict]) -> int:
    return max(i for i, r in enumerate(records) if r["event"] == "start")


def swap_two_ids(records: list[dict]) -> bool:
    """Swap two ids inside a batch that only the last process trained (so only the reference can tell)."""
    last = _last_attempt_start(records)
    earlier = {r["step"] for r in records[:last] if r["event"] == "batch"}
    for record in records[last:]:
        if record["event"] == "batch" and record["step"] not in earlier and len(set(record["ids"])) > 1:
            ids = record["ids"]
            ids[0], ids[-1] = ids[-1], ids[0]
            return True
    return False


def drop_a_batch(records: list[dict]) -> bool:
    """Drop a batch from the middle of the last attempt."""
    batches = [i for i, r in enumerate(records) if r["event"] == "batch" and i > _last_attempt_start(records)]
    if len(batches) < 2:
        return False
    del records[batches[len(batches) // 2]]
    return True


def change_a_replayed_step(records: list[dict]) -> bool:
    """Change what the killed run trained at a step that the resumed run trained again."""
    last = _last_attempt_start(records)
    retrained = {r["step"] for r in records[last:] if r["event"] == "batch"}
    for record in records[:last]:
        if record["event"] == "batch" and record["step"] in retrained:
            record["ids"] = list(reversed(record["ids"])) if len(set(record["ids"])) > 1 else [-1]
            return True
    return False


PERTURBATIONS: dict[str, Callable[[list[dict]], bool]] = {
    "two ids swapped in a batch after the last resume": swap_two_ids,
    "a resumed batch dropped": drop_a_batch,
    "a re-trained step changed in the killed run": change_a_replayed_step,
}


REJECTED, MISSED, NOT_APPLICABLE = "rejected", "NOT DETECTED", "not applicable"


def self_check(reference_dir: Path, interrupted_dir: Path, work_dir: Path) -> dict[str, str]:
    """Damage copies of rank 0's interrupted stream and verify each; maps each damage to its outcome.

    The outcome is ``REJECTED`` (the verifier caught it), ``MISSED`` (it did
    not: the verifier is broken) or ``NOT_APPLICABLE`` (e.g. no step was re-trained).
    """
    stream = interrupted_dir / "stream_rank0.jsonl"
    records = [json.loads(line) for line in stream.read_text("utf-8").splitlines() if is_json(line)]
    outcomes = {}
    for name, perturb in PERTURBATIONS.items():
        damaged = json.loads(json.dumps(records))
        if not perturb(damaged):
            outcomes[name] = NOT_APPLICABLE
            print(f"  self-check: {name}: {NOT_APPLICABLE} to this run")
            continue
        copy = work_dir / name.replace(" ", "_")
        shutil.copytree(interrupted_dir, copy, ignore=shutil.ignore_patterns("checkpoints", "*.log"))
        (copy / stream.name).write_text("".join(json.dumps(r) + "\n" for r in damaged), "utf-8")
        verdict = verify(reference_dir, copy)
        found = verdict.ranks[0].problems + verdict.epoch_problems
        outcomes[name] = MISSED if verdict.ok else REJECTED
        print(f"  self-check: {name}: {outcomes[name]}" + (f": {found[0]}" if found else ""))
    return outcomes


def is_json(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True
