"""The elastic grid, chained (issue 28 §4): every change of (processes, workers) in {1,2,3,4} × {0,1,2,4}.

A **chain** is one training run started 6 times (5 resumes), each launch on a *cell* (processes, workers);
each launch trains a few steps on ``mp_grid.py``'s pipeline (``Packed(Mixture(Filtered(exact_shuffle(🤗
stream)), StreamingDataset, table))``), saves, and stops; the chain's last launch runs to the end of the data.
:func:`plan` cuts an Eulerian circuit of the 16 cells, with every ordered pair of distinct cells once and every
cell followed by itself once, into chains of 5 transitions: 52 chains cover the 240 changes of topology and
the 16 same-topology resumes. Every link of every chain that runs on one cell at one depth shares a launch.

Checked per chain (:func:`check_chain`): the first launch's rows are a plain ``DataLoader``'s over the
pipeline (the uninterrupted run: the dispatcher deals its batches to the ranks in turn); a launch resumed on
the cell it was saved on repeats, row for row, the steps its predecessor trained after the save; over the
chain every source delivers its documents in its own order, each token once, none lost, to the end.

The full grid is a ``make soak`` step; ``tests/test_grid_mp.py`` runs one chain through all 4 process and
all 4 worker counts::

    python tests/grid.py --out grid_out            # the whole grid; --chains 0,5 for some of it
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Sequence

import mp_harness
import mp_grid
from mp_grid import lm
from test_lm_pipeline_mp import kept_rows, read_launch, source_orders, steps_of, uninterrupted

SCRIPT = Path(mp_grid.__file__)
PROCESSES, WORKERS = (1, 2, 3, 4), (0, 1, 2, 4)
CELLS = list(itertools.product(PROCESSES, WORKERS))
DEPTH = 5  # resumes per chain
TAIL = 2  # steps a launch trains past its save when the next one resumes on the same cell
Cell = tuple[int, int]
# The suite's chain: all 4 process counts, all 4 worker counts, and a resume on the cell it was saved on.
CI_CHAIN = [(1, 0), (2, 1), (2, 1), (4, 2), (3, 4), (1, 2)]


def circuit() -> list[Cell]:
    """An Eulerian circuit (Hierholzer) over every ordered pair of cells, a cell to itself included, from the
    first cell: 257 cells, 256 transitions, each once."""
    left = {cell: [c for c in reversed(CELLS) if c != cell] + [cell] for cell in CELLS}  # itself first
    stack, path = [CELLS[0]], []
    while stack:
        if left[stack[-1]]:
            stack.append(left[stack[-1]].pop())
        else:
            path.append(stack.pop())
    return path[::-1]


def plan() -> list[list[Cell]]:
    """The grid's chains: the circuit's transitions cut in runs of ``DEPTH``, the last one wrapping round."""
    cells = circuit()[:-1]  # the circuit ends where it starts
    return [[cells[(start + k) % len(cells)] for k in range(DEPTH + 1)] for start in range(0, len(cells), DEPTH)]


def advance(chain: int, depth: int, world: int) -> int:
    """The steps a launch trains before its save: 3 to 5 of the base loader's batches, fewer than the data
    holds over a chain (42 batches) on every cell."""
    return max(1, (3 + (chain + depth) % 3) // world)


def stops(number: int, chain: Sequence[Cell]) -> list[int]:
    """The step each launch of the chain saves and stops at; ``-1``: the last runs to the end of the data."""
    found, step = [], 0
    for depth, (world, _) in enumerate(chain[:-1]):
        step += advance(number, depth, world)
        found.append(step)
    return found + [-1]


def run(out: Path, chains: dict[int, list[Cell]], timeout_s: float = 600.0, log=print) -> list[dict]:
    """Launch every link of ``chains`` (by number), depth by depth, one launch per cell; the launches' results."""
    data = out / "data"
    if not (data / "mds").exists():
        mp_grid.write_data(data)
    results = []
    for depth in range(DEPTH + 1):
        for cell in CELLS:
            here = [n for n, chain in chains.items() if chain[depth] == cell]
            if here:
                results.append(_launch(out, chains, depth, cell, here, timeout_s))
                log(json.dumps(results[-1]))
    return results


def _launch(out: Path, chains: dict, depth: int, cell: Cell, numbers: list[int], timeout_s: float) -> dict:
    world, workers = cell
    folder = out / "launches" / f"depth{depth}_p{world}w{workers}"
    folder.mkdir(parents=True, exist_ok=True)
    links = []
    for n in numbers:
        chain = chains[n]
        (out / f"chain{n:02d}").mkdir(exist_ok=True)
        same = depth < DEPTH and chain[depth + 1] == cell
        links.append({"chain": str(out / f"chain{n:02d}"), "index": depth, "stop": stops(n, chain)[depth],
                      "tail": TAIL if same else 0})
    (folder / "plan.json").write_text(json.dumps({"workers": workers, "links": links}))
    command = mp_harness.accelerate_command(SCRIPT, [out / "data", folder / "plan.json"], world)
    done = mp_harness.launch(command, folder, timeout_s=timeout_s, collective_timeout_s=120,
                             watch=[out / f"chain{n:02d}" for n in numbers], HF_HOME=str(out / "hf_home"))
    if not done.ok:
        (folder / "report.txt").write_text(done.report())
    return {"depth": depth, "cell": cell, "chains": numbers, "ok": done.ok, "seconds": round(done.seconds, 1),
            "folder": str(folder)}


def check_chain(out: Path, number: int, chain: Sequence[Cell], references: dict[int, list]) -> list[str]:
    """What is wrong with chain ``number`` (nothing: an empty list). ``references``: the uninterrupted rows
    per worker count, filled as needed."""
    folder = out / f"chain{number:02d}"
    missing = [i for i, (world, _) in enumerate(chain) if not (folder / f"launch{i}_rank{world - 1}.jsonl").exists()]
    if missing:
        return [f"chain {number} {chain}: launches {missing} left no record"]
    launches = [read_launch(folder, index, world) for index, (world, _) in enumerate(chain)]
    kept, starts = kept_rows(launches)
    problems = []
    expected = [0] + stops(number, chain)[:-1]
    if starts != expected:
        problems.append(f"the launches resumed at steps {starts}, not at the saves {expected}")
    if not any("done" in entry for entry in launches[-1][0]):
        problems.append("the last launch did not reach the end of the data")
    saved_early = [i for i, ranks in enumerate(launches[:-1]) if any("done" in e for e in ranks[0])]
    if saved_early:
        problems.append(f"launches {saved_early} reached the end of the data before their save")
    if "rows" not in references:  # the same on every number of processes and workers (``uninterrupted``)
        references["rows"] = uninterrupted(out / "data", 1, mp_grid.pipeline(out / "data"))
    if kept[0] != references["rows"][: len(kept[0])]:
        problems.append(f"the first launch on {chain[0]} is not the uninterrupted run")
    for index in range(DEPTH):
        if chain[index] == chain[index + 1]:
            resumed, before = (steps_of(launches[i], after=starts[index + 1]) for i in (index + 1, index))
            both = min(len(resumed), len(before))
            if not both or resumed[:both] != before[:both]:
                problems.append(f"launch {index + 1}, resumed on {chain[index]} where it was saved, is not the "
                                f"{both} steps launch {index} trained past the save")
    rows = [row for launch in kept for row in launch]
    problems += source_problems(out / "data", rows, len(rows) - len(kept[-1]))
    return [f"chain {number} {chain}: {problem}" for problem in problems]


def source_problems(data: Path, rows: list[list[int]], before_last: int = 0) -> list[str]:
    """A token delivered twice, or one missing that a later one of its source was delivered before the last
    launch (the first ``before_last`` rows): the end of the data drops the rows of a partial last step, which
    worker shares interleave, so a source's last tokens may be missing where the last launch ends."""
    orders = source_orders(data)
    orders["web"] = [token for token in orders["web"] if mp_grid.keep({"input_ids": [token]})]
    problems = []
    for name in lm.SOURCES:
        place = {token: index for index, token in enumerate(orders[name])}
        got = [place[t] for row in rows for t in row if lm.decode(t)[0] == name]
        earlier = [place[t] for row in rows[:before_last] for t in row if lm.decode(t)[0] == name]
        if len(got) != len(set(got)):
            problems.append(f"source {name!r} repeated {len(got) - len(set(got))} tokens")
        lost = set(range(max(earlier, default=-1))) - set(got)
        if lost:
            problems.append(f"source {name!r} lost {len(lost)} tokens, the first {orders[name][min(lost)]}")
    return problems


def check(out: Path, chains: dict[int, list[Cell]]) -> tuple[list[str], dict]:
    """Every chain's problems, and the figures: chains, transitions (distinct changes, same-topology) passed."""
    references: dict = {}
    problems, passed = [], []
    for number, chain in chains.items():
        found = check_chain(out, number, chain, references)
        problems += found
        passed += [] if found else [number]
    figures = {"chains": len(chains), "chains_passed": len(passed)}
    for name, numbers in (("covered", chains), ("passed", passed)):
        found = {(chains[n][i], chains[n][i + 1]) for n in numbers for i in range(DEPTH)}
        figures[f"changes_{name}"] = sum(a != b for a, b in found)
        figures[f"same_topology_{name}"] = sum(a == b for a, b in found)
    return problems, figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("grid_out"))
    parser.add_argument("--chains", default="", help="comma-separated chain numbers (default: all)")
    parser.add_argument("--check-only", action="store_true", help="check what OUT holds, launching nothing")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="a launch still running then is a hang")
    args = parser.parse_args()
    everything = dict(enumerate(plan()))
    chains = {int(n): everything[int(n)] for n in args.chains.split(",")} if args.chains else everything
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results = [] if args.check_only else run(args.out, chains, args.timeout_s, log=lambda line: print(line, flush=True))
    problems, figures = check(args.out, chains)
    failed = [r["folder"] for r in results if not r["ok"]]
    figures.update(launches=len(results), launches_failed=failed, minutes=round((time.monotonic() - started) / 60, 1))
    print("\n".join(problems))
    print(json.dumps(figures))
    sys.exit(1 if problems or failed else 0)


if __name__ == "__main__":
    main()
