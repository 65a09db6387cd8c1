"""Generated training programs resume exactly on 2 and 3 real processes (gloo): the property test of
``test_lifecycle_programs.py`` where the ranks can differ.

One launch of ``mp_lifecycle.py`` runs every program on both ranks, with the parts a program draws per rank (a
caught exception kept on one rank, the garbage collector off or run often on one rank). Every rank's resumed
traces must continue its uninterrupted trace exactly, which they cannot if two ranks recorded different
positions in one checkpoint. The refusal programs keep an iterator reachable on one rank only: every rank must
raise the same refusal, and no rank may go on into a collective the other never reaches (the harness's
watchdog would end the launch and print every rank's stack).

``LIFECYCLE_MP_SEED`` picks another first seed (the programs are ``lifecycle_programs.draw(seed, world)``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import mp_harness

SCRIPT = Path(__file__).with_name("mp_lifecycle.py")
FIRST_SEED = int(os.environ.get("LIFECYCLE_MP_SEED", "100"))  # the 1-process test draws seeds 0-23
# (processes, programs, refusals): the programs differ per world (lifecycle_programs.draw(seed, world)).
# ``LIFECYCLE_MP_LAUNCHES="2:300:30,3:150:15"`` runs hundreds (``make programs``; CI runs 220 of them after ``make
# test``); the suite runs the first few of those.
LAUNCHES = [tuple(map(int, launch.split(":")))
            for launch in os.environ.get("LIFECYCLE_MP_LAUNCHES", "2:6:2,3:3:1").split(",")]
LAUNCH_TIMEOUT_S = max(300, max(15 * (count + refusals) for _, count, refusals in LAUNCHES))


@pytest.mark.multiprocess
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize("world, count, refusals", LAUNCHES, ids=[f"world{w}" for w, _, _ in LAUNCHES])
def test_generated_programs_resume_exactly_or_are_refused_alike_on_every_rank(tmp_path, world, count, refusals):
    out = tmp_path / "out"
    out.mkdir()
    command = mp_harness.accelerate_command(SCRIPT, [out, FIRST_SEED, count, refusals], world=world)
    done = mp_harness.launch(command, tmp_path / "launch", timeout_s=LAUNCH_TIMEOUT_S, watch=[out])
    report = done.report()
    print(f"{count} programs and {refusals} refusals from seed {FIRST_SEED} on {world} processes in {done.seconds} s")
    assert done.ok, report
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]
    expected = [(s, False) for s in range(FIRST_SEED, FIRST_SEED + count)]
    expected += [(s, True) for s in range(FIRST_SEED, FIRST_SEED + refusals)]
    problems = []
    for rank, results in enumerate(ranks):
        ran = [(r["seed"], r["refusal_expected"]) for r in results]
        if ran != expected:
            problems.append(f"rank {rank} ran {ran}, expected {expected}")
        problems += [f"rank {rank}, seed {r['seed']}: {r['program']}\n  " + "\n  ".join(r["found"])
                     for r in results if not r["refusal_expected"] and r["found"]]
    for results in zip(*ranks):
        if results[0]["refusal_expected"]:
            refusals_seen = [r["found"] for r in results]
            alike = all(len(f) == 1 and f[0].startswith("refused: ") for f in refusals_seen)
            if not alike or any(f != refusals_seen[0] for f in refusals_seen):
                problems.append(f"seed {results[0]['seed']} (an iterator kept on one rank only): every rank must "
                                f"raise the same refusal; " + "; ".join(
                                    f"rank {rank}: {found}" for rank, found in enumerate(refusals_seen)))
    assert not problems, "\n\n".join(problems) + "\n\n" + report
