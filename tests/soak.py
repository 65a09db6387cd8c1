"""Many short 2-process launches in a row: does every one of them end, and end well?

Two kinds of launch, each through the multi-process harness (``mp_harness.py``: a watchdog at 3/4 of the
collective timeout dumps the stack of every rank and DataLoader worker into the launch's ``stacks.log``, then
kills the job; nothing is launched twice):

- ``exit`` (``mp_soak.py``): every kind of loader with workers, a checkpoint, one loader abandoned mid-epoch,
  ``accelerator.end_training()``; the launch must exit, without "terminate called" in its output.
- ``scenarios`` (``mp_scenarios.py``): the resume scenario sets of ``ALL_SETS``, ``--per-launch`` scenarios a
  launch (about 10 s), rotating through every scenario of every set; launch ``i`` of the rotation is the same
  whatever chunk runs it (``--first``), so a soak can be run in chunks.

Each launch appends one JSON line to ``OUT/soak.jsonl``: its scenarios, seconds, status, whether the watchdog
fired (a hang), the scenarios that failed, processes left running, the machine's load. ``--summary`` reads every
line there (all chunks) and prints the figures::

    python tests/soak.py --kind scenarios --first 0 --launches 30 --out soak_out
    python tests/soak.py --summary --out soak_out
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import mp_harness
from mp_scenarios import ALL_SETS, expected_ids

ROOT = mp_harness.ROOT
TESTS = ROOT / "tests"
TERMINATE = "terminate called"
SCENARIO_TIMEOUT_S = 120.0  # mp_scenarios' collective timeout


@dataclass
class Result:
    index: int
    kind: str
    set_name: str
    scenarios: list[str]
    seconds: float
    returncode: Optional[int]  # None: the watchdog ended it
    watchdog: Optional[str]
    failed: list[str] = field(default_factory=list)  # scenarios a rank reported as failed, or never finished
    terminate_message: bool = False
    leftovers: list[str] = field(default_factory=list)
    load: float = 0.0  # the 1-minute load average when the launch started
    folder: str = ""

    @property
    def hung(self) -> bool:
        return self.watchdog is not None

    @property
    def ok(self) -> bool:
        return not self.hung and self.returncode == 0 and not self.failed and not self.terminate_message


def rotation(per_launch: int) -> list[tuple[str, list[str]]]:
    """Every scenario of every set, ``per_launch`` of one set per launch, in a fixed order."""
    launches = []
    for set_name in ALL_SETS:
        ids = expected_ids(set_name)
        launches += [(set_name, ids[i:i + per_launch]) for i in range(0, len(ids), per_launch)]
    return launches


def world(set_name: str) -> int:
    return int(set_name.rsplit("world", 1)[1])


def launch_scenarios(index: int, out: Path, per_launch: int, timeout_s: float) -> Result:
    set_name, ids = rotation(per_launch)[index % len(rotation(per_launch))]
    folder = out / f"launch_{index:04d}"
    results = folder / "results"
    results.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    command = mp_harness.accelerate_command(TESTS / "mp_scenarios.py", [results, set_name, ",".join(ids)],
                                            world(set_name))
    done = mp_harness.launch(command, folder, timeout_s=timeout_s, collective_timeout_s=SCENARIO_TIMEOUT_S,
                             watch=[results], HF_HOME=str(folder / "hf_home"))
    failed = []
    for rank in range(world(set_name)):
        path = results / f"rank{rank}.json"
        reported = {r["id"]: r for r in json.loads(path.read_text())} if path.exists() else {}
        failed += [f"{sid} (rank {rank})" for sid in ids if not reported.get(sid, {}).get("passed")]
    return _result(index, "scenarios", set_name, ids, done, failed, load)


def launch_exit(index: int, out: Path, timeout_s: float) -> Result:
    folder = out / f"launch_{index:04d}"
    load = os.getloadavg()[0]
    done = mp_harness.launch(mp_harness.accelerate_command(TESTS / "mp_soak.py", [folder]), folder,
                             timeout_s=timeout_s, watch=[folder / "project"])
    failed = [f"rank {rank} did not reach the end" for rank in range(2) if not (folder / f"done_rank{rank}").exists()]
    return _result(index, "exit", "mp_soak", [], done, failed, load)


def _result(index: int, kind: str, set_name: str, ids: list[str], done: mp_harness.Launch, failed: list[str],
            load: float) -> Result:
    result = Result(index, kind, set_name, ids, done.seconds, done.returncode, done.watchdog, failed,
                    TERMINATE in done.output, done.leftovers, round(load, 2), str(done.folder))
    if not result.ok:
        (done.folder / "report.txt").write_text(done.report())
    return result


def soak(launches: int, out: Path, kind: str = "exit", first: int = 0, per_launch: int = 1,
         timeout_s: float = 300.0, budget_s: Optional[float] = None) -> list[Result]:
    """Run launches ``first`` .. ``first + launches - 1`` (fewer if ``budget_s`` runs out), one line each."""
    out.mkdir(parents=True, exist_ok=True)
    results: list[Result] = []
    started = time.monotonic()
    for index in range(first, first + launches):
        if budget_s is not None and results and time.monotonic() - started + timeout_s > budget_s:
            break
        if kind == "exit":
            result = launch_exit(index, out, timeout_s)
        else:
            result = launch_scenarios(index, out, per_launch, timeout_s)
        results.append(result)
        line = json.dumps(asdict(result))
        with open(out / "soak.jsonl", "a") as log:
            log.write(line + "\n")
        print(line, flush=True)
    return results


def summary(out: Path) -> tuple[str, bool]:
    """The figures of every launch recorded under ``out`` (all chunks), and whether every launch was ok."""
    rows = [json.loads(line) for line in (out / "soak.jsonl").read_text().splitlines() if line.strip()]
    results = [Result(**row) for row in rows]
    hung = [r.index for r in results if r.hung]
    failed = [r.index for r in results if not r.hung and not r.ok]
    times = [r.seconds for r in results if not r.hung] or [float("nan")]
    loads = [r.load for r in results] or [float("nan")]
    scenarios = {(r.set_name, s) for r in results for s in r.scenarios}
    text = (f"{len(results)} launches ({len(scenarios)} distinct scenarios): {len(hung)} hung {hung}, "
            f"{len(failed)} failed {failed}; seconds min {min(times):.1f} median {statistics.median(times):.1f} "
            f"max {max(times):.1f}; load average min {min(loads):.2f} median {statistics.median(loads):.2f} "
            f"max {max(loads):.2f}")
    return text, not hung and not failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", choices=("exit", "scenarios"), default="exit")
    parser.add_argument("--launches", type=int, default=100)
    parser.add_argument("--first", type=int, default=0, help="index of the first launch (the rotation's place)")
    parser.add_argument("--per-launch", type=int, default=1, help="scenarios a launch (--kind scenarios)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="a launch still running then is a hang")
    parser.add_argument("--out", type=Path, default=Path("soak_out"))
    parser.add_argument("--summary", action="store_true", help="only print the figures of what OUT holds")
    args = parser.parse_args()
    if not args.summary:
        soak(args.launches, args.out, args.kind, args.first, args.per_launch, args.timeout_s)
    text, ok = summary(args.out)
    print(text)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
