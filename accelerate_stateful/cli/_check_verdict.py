"""The verdict of ``check-resume`` in the user's words: identical, or the first difference and the kill before it."""

from __future__ import annotations

import signal

from ._stitch import Verdict


def verdict_text(verdict: Verdict, kills: list, resumes: int, sig: signal.Signals, ranks: int) -> str:
    """The verdict in words; ``kills``: the step each run of the chain had recorded when it was killed, or None."""
    where = (f"{verdict.steps} steps on {ranks} rank(s), {sum(k is not None for k in kills)} kill(s), "
             f"{resumes} resume(s)")
    if verdict.kind == "identical" and verdict.note:
        return (f"identical samples on every number of processes: every step's samples, all ranks together, are "
                f"those of the uninterrupted run ({where}); {verdict.note}")
    if verdict.kind == "identical":
        return f"identical: every batch, loss and weight of the {where} matches the uninterrupted run"
    head = (f"identical samples, weights differ from step {verdict.step}" if verdict.kind == "weights"
            else f"DIFFERENT samples from step {verdict.step}")
    rank = "all ranks together" if verdict.rank is None else f"rank {verdict.rank}"
    lines = [f"{head} ({rank}; {_after_kill(verdict, kills, sig)}; {where}):"]
    for expected, came in zip(verdict.expected, verdict.came):
        lines += [f"  expected {expected}", f"  came     {came}"]
    return "\n".join(lines)


def _after_kill(verdict: Verdict, kills: list, sig: signal.Signals) -> str:
    if verdict.run is None or verdict.run == 0:
        return ("before any kill: the first run already differs, so the script does not repeat itself when run "
                "twice (unseeded randomness, or the output folder not fresh?)")
    return f"after kill {verdict.run}: {sig.name} at step {kills[verdict.run - 1]}, then run {verdict.run + 1}"
