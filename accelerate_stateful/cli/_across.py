"""``check-resume --processes``: a chain resumed on other process counts, compared with what does not change.

Across process counts each rank's batches differ, so the comparison is global: step by step, the samples of all
ranks together (a short digest per sample, recorded by ``training/_record.py``) must be the uninterrupted run's,
each as often. Where the global batch differs in size (the per-rank batch is not scaled with the world size),
the samples are compared at each point where both runs have consumed the same number of them. The loss (the mean
over ranks of each rank's losses in the step) and the parameters' norm are compared only where every step's
global batch is the same, and within :data:`RTOL`, never bitwise: all-reduce sums in another order on another
process count.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Optional

from ._stitch import Verdict

RTOL = 1e-4  # relative tolerance of the loss and the parameters' norm across process counts
ATOL = 1e-6


def stitch_across(runs: list[dict[int, list[dict]]]) -> dict[int, dict[int, dict]]:
    """Step -> rank -> record, over a chain of runs on any process counts: a run's first step replaces that step
    and every later one on every rank (a rank the run no longer has included), tagged with the run's index."""
    steps: dict[int, dict[int, dict]] = {}
    for index, lines_by_rank in enumerate(runs):
        mine = [r for lines in lines_by_rank.values() for r in lines if r.get("event") == "step"]
        if not mine:
            continue
        first = min(r["step"] for r in mine)
        for later in [s for s in steps if s >= first]:
            del steps[later]
        for rank, lines in lines_by_rank.items():
            for record in lines:
                if record.get("event") == "step":
                    steps.setdefault(record["step"], {})[rank] = {**record, "run": index}
    return dict(sorted(steps.items()))


def _samples(by_rank: dict[int, dict]) -> list[str]:
    return [d for rank in sorted(by_rank) for batch in by_rank[rank]["batches"] for d in batch[2]]


def _peeks(by_rank: Optional[dict[int, dict]]) -> str:
    if not by_rank:
        return "nothing: the run ended before it"
    return "; ".join(f"rank {rank} " + ", ".join(b[1] or "no tensor" for b in by_rank[rank]["batches"])
                     for rank in sorted(by_rank))


def compare_across(reference: dict[int, dict[int, dict]], chain: dict[int, dict[int, dict]]) -> Verdict:
    """The first step where the chain's samples (all ranks together), then its loss or weights, differ."""
    total = max(reference, default=0)
    ref, got = list(reference.items()), list(chain.items())
    same_sizes = len(ref) == len(got) and all(len(_samples(a)) == len(_samples(b)) for (_, a), (_, b) in zip(ref, got))
    i = j = used_ref = used_got = compared = 0
    pending: Counter = Counter()
    while i < len(ref) or j < len(got):
        if j >= len(got) or (i < len(ref) and used_ref <= used_got):
            for d in _samples(ref[i][1]):
                pending[d] += 1
            used_ref += len(_samples(ref[i][1]))
            i += 1
        else:
            for d in _samples(got[j][1]):
                pending[d] -= 1
            used_got += len(_samples(got[j][1]))
            j += 1
        if used_ref == used_got:
            compared = used_ref
        if not same_sizes and (i == len(ref) and used_got >= used_ref or j == len(got) and used_ref >= used_got):
            # One run ended first (a fixed number of steps of another global batch): the other's step that went
            # past its end must hold every sample it has not matched yet, and nothing else of what was compared.
            beyond = -1 if i == len(ref) else 1  # the sign of the samples the longer run took past the end
            if any(count * beyond < 0 for count in pending.values()):
                return _samples_verdict(total, got[j - 1][0] if j else 1, reference, chain, pending)
            compared = min(used_ref, used_got)
            break
        if (used_ref == used_got or i == len(ref) and j == len(got)) and any(pending.values()):
            step = got[j - 1][0] if j else 1
            if i == len(ref) and j == len(got) and len(got) < len(ref):
                step = got[-1][0] + 1 if got else 1  # the chain stopped short
            return _samples_verdict(total, step, reference, chain, pending)
    if not same_sizes:
        return Verdict("identical", total, note=f"compared over the first {compared} samples, which both runs took; "
                       "loss and weights not compared: the global batch differs between process counts (scale the "
                       "per-rank batch with the number of processes to compare them)")
    for (step, a), (_, b) in zip(ref, got):
        found = _weights_differ(a, b)
        if found is not None:
            return Verdict("weights", total, step, min(b), b[min(b)]["run"], *found)
    return Verdict("identical", total, note=f"losses and parameters' norm equal within a relative {RTOL:g} (not "
                   "bitwise: all-reduce adds in another order on another number of processes)")


def _samples_verdict(total: int, step: int, reference: dict, chain: dict, pending: Counter) -> Verdict:
    missing, extra = sum(v for v in pending.values() if v > 0), -sum(v for v in pending.values() if v < 0)
    run = next((r["run"] for r in chain.get(step, {}).values()), None)
    if run is None:
        run = max((r["run"] for s in chain.values() for r in s.values()), default=None)
    return Verdict("samples", total, step, None, run,
                   [f"samples of the step on all ranks: {_peeks(reference.get(step))}"],
                   [f"samples of the step on all ranks: {_peeks(chain.get(step))} ({missing} sample(s) of the "
                    f"uninterrupted run missing so far, {extra} not in it or repeated)"])


def _loss(by_rank: dict[int, dict]) -> float:
    return sum(sum(r["losses"]) for r in by_rank.values()) / len(by_rank)


def _weights_differ(ref: dict[int, dict], got: dict[int, dict]) -> Optional[tuple[list, list]]:
    expected, came = [], []
    if not math.isclose(_loss(ref), _loss(got), rel_tol=RTOL, abs_tol=ATOL):
        expected.append(f"loss (mean over ranks) {_loss(ref)!r}")
        came.append(f"loss (mean over ranks) {_loss(got)!r}")
    a, b = ref[min(ref)].get("norm"), got[min(got)].get("norm")
    if a is not None and b is not None and not math.isclose(a, b, rel_tol=RTOL, abs_tol=ATOL):
        expected.append(f"parameters' norm after the step {a!r}")
        came.append(f"parameters' norm after the step {b!r}")
    return (expected, came) if expected else None
