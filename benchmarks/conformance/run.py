"""The resume-correctness table: every loader people use for the same job, killed and resumed the same ways.

    python benchmarks/conformance/run.py --json bench_out/conformance.json --markdown bench_out/conformance.md
    python benchmarks/conformance/run.py --quick     # the suite's subset (tests/test_conformance_table.py)

``make conformance`` runs the whole matrix (under 20 minutes on 2 cores), writes the table into
docs/benchmarks.md and the figure into docs/figures/conformance.png, and refreshes expected.json, the
verdicts the suite holds each pinned release to. Each row is used as its own documentation says
(``peers.py``); the scenarios are ``scenarios.py``'s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import cells  # noqa: E402
import mp  # noqa: E402
from _common import environment, jsonable  # noqa: E402
from peers import PEERS  # noqa: E402
from scenarios import QUICK, SCENARIOS  # noqa: E402

EXPECTED = HERE / "expected.json"


def measure_all(quick: bool, rounds: int) -> dict:
    """``{row: {"versions", "cells": {scenario: result}, "first_batch_s"}}``."""
    cells.quiet()
    chosen = [s for s in SCENARIOS if not quick or s.key in QUICK]
    rows, launched = {}, {}
    for index, peer in enumerate(PEERS):
        missing = peer.missing()
        row = rows[peer.name] = {"how": peer.how, "versions": peer.versions(), "cells": {}}
        if missing:
            row["cells"] = {s.key: {"verdict": "not yet measured", "reason": missing} for s in chosen}
            continue
        for scenario in chosen:
            if scenario.processes != (1, 1):  # measured in mp.py's launches, after every row's 1-process cells
                launched[index] = peer
                continue
            started = time.perf_counter()
            row["cells"][scenario.key] = cells.measure(peer, scenario)
            print(f"{peer.name:40} {scenario.key:15} {row['cells'][scenario.key]['verdict']:10}"
                  f" {time.perf_counter() - started:5.1f} s", flush=True)
        if not quick:
            row["first_batch_s"] = cells.time_to_first_batch(peer, rounds)
    for index, result in mp.measure(launched).items() if launched else ():
        rows[PEERS[index].name]["cells"]["1-to-2"] = result
    return rows


def verdicts(rows: dict) -> dict:
    """What the suite compares: each cell's verdict and counts, keyed by the row's pinned releases."""
    keep = ("verdict", "lost", "repeated", "order_differs")
    return {name: {"versions": row["versions"],
                   "cells": {key: {k: v for k, v in cell.items() if k in keep} for key, cell in row["cells"].items()}}
            for name, row in rows.items()}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"only the scenarios {', '.join(QUICK)}, no timing")
    parser.add_argument("--rounds", type=int, default=3, help="timed resumes per position (the median is kept)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    parser.add_argument("--markdown", metavar="PATH", help="write the table as markdown to PATH")
    parser.add_argument("--expected", action="store_true", help=f"also write the verdicts to {EXPECTED.name}")
    args = parser.parse_args(argv)
    env, started = environment(), time.perf_counter()
    rows = measure_all(args.quick, args.rounds)
    env["benchmark wall time (s)"] = f"{time.perf_counter() - started:.0f}"
    document = {"environment": env, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(jsonable(document), indent=1, ensure_ascii=False), encoding="utf-8")
    if args.expected:
        EXPECTED.write_text(json.dumps(verdicts(rows), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    import report

    text = report.markdown(document)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
