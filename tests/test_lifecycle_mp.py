"""Generated training programs resume exactly on 2 real processes (gloo): the property test of
``test_lifecycle_programs.py`` where the ranks can differ.

One launch of ``mp_lifecycle.py`` runs every program on both ranks, with the parts a program draws per rank (a
caught exception kept on one rank, the garbage collector off or run often on one rank). Every rank's resumed
traces must continue its uninterrupted trace exactly, which they cannot if two ranks recorded different
positions in one checkpoint. The refusal programs keep an iterator reachable on one rank only: every rank must
raise the same refusal, and no rank may go on into a collective the other never reaches (the harness's
watchdog would end the launch and print every rank's stack).

``LIFECYCLE_MP_SEED`` picks another first seed (the programs are ``lifecycle_programs.draw(seed, 2)``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import mp_harness

SCRIPT = Path(__file__).with_name("mp_lifecycle.py")
FIRST_SEED = int(os.environ.get("LIFECYCLE_MP_SEED", "100"))  # the 1-process test draws seeds 0-23
PROGRAMS, REFUSALS = 16, 4


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_generated_programs_resume_exactly_or_are_refused_alike_on_every_rank(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    command = mp_harness.accelerate_command(SCRIPT, [out, FIRST_SEED, PROGRAMS, REFUSALS])
    done = mp_harness.launch(command, tmp_path / "launch", timeout_s=240, watch=[out])
    report = done.report()
    print(f"{PROGRAMS} programs and {REFUSALS} refusals from seed {FIRST_SEED} on 2 processes in {done.seconds} s")
    assert done.ok, report
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    expected = [(s, False) for s in range(FIRST_SEED, FIRST_SEED + PROGRAMS)]
    expected += [(s, True) for s in range(FIRST_SEED, FIRST_SEED + REFUSALS)]
    problems = []
    for rank, results in enumerate(ranks):
        ran = [(r["seed"], r["refusal_expected"]) for r in results]
        if ran != expected:
            problems.append(f"rank {rank} ran {ran}, expected {expected}")
        problems += [f"rank {rank}, seed {r['seed']}: {r['program']}\n  " + "\n  ".join(r["found"])
                     for r in results if not r["refusal_expected"] and r["found"]]
    for first, second in zip(*ranks):
        if first["refusal_expected"]:
            refusals = [first["found"], second["found"]]
            if not all(len(f) == 1 and f[0].startswith("refused: ") for f in refusals) or refusals[0] != refusals[1]:
                problems.append(f"seed {first['seed']} (an iterator kept on rank 0 or 1 only): every rank must "
                                f"raise the same refusal; rank 0: {refusals[0]}, rank 1: {refusals[1]}")
    assert not problems, "\n\n".join(problems) + "\n\n" + report
