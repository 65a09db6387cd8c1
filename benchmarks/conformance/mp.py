"""The 1 -> 2 processes column: each loader trains on one process here and saves mid-epoch, then real launches
of 2 gloo processes (``tests/mp_harness.py``, as the suite launches) resume it: one launch for the loaders that
leave torch.distributed alone, one each for those that start it.

The verdict is per epoch: every sample of each epoch must come once across both processes and the one before
them (their order across processes is no single sequence to compare).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent / "tests"))

import mp_harness  # noqa: E402

from cells import failure  # noqa: E402
from scenarios import BATCH, BY_KEY, per_epoch_verdict  # noqa: E402

TIMEOUT_S, STALL_S = 300, 45
# A row whose failure leaves a rank waiting in a collective ends its launch: the rows not done by then are
# resumed again, each in a launch of its own.


def measure(peers: dict) -> dict:
    """``{row index: result}`` for ``peers`` (``{index: Peer}``), one launch for all of them."""
    scenario, results, prepared = BY_KEY["1-to-2"], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for index, peer in peers.items():
            folder = root / str(index)
            folder.mkdir()
            try:
                with tempfile.TemporaryDirectory() as ref:
                    expected = peer.segment(scenario, Path(ref), 0, None)
                kill = scenario.kill_steps(-(-sum(1 for e, _ in expected if e == 0) // BATCH))[0]
                prepared[index] = (expected, peer.segment(scenario, folder, 0, kill), kill)
            except Exception as exc:
                results[index] = {**failure(exc), "note": "on 1 process, before the launch"}
        # A row that starts torch.distributed (Accelerate, the Trainer) owns its processes, as its script would:
        # it gets a launch of its own; the rows that never start it share one.
        groups = [[i] for i in prepared if peers[i].owns_processes]
        groups.append([i for i in prepared if not peers[i].owns_processes])
        ended = {}
        for n, rows in enumerate(g for g in groups if g):
            ended.update(_launch(root, rows, f"launch{n}"))
        for index in [i for i in prepared if not _done(root, i)]:  # after a row that left a rank behind
            ended[index] = _launch(root, [index], f"launch-{index}")[index]
        for index, (expected, before, kill) in prepared.items():
            ranks = [root / str(index) / f"rank{r}.json" for r in range(2)]
            if not _done(root, index):
                results[index] = {"verdict": "crashed", "error": ended[index]}
                continue
            parts = [json.loads(path.read_text()) for path in ranks]
            failed = next((p for p in parts if "trained" not in p), None)
            if failed:
                results[index] = failed
                continue
            trained = before + [tuple(pair) for part in parts for pair in part["trained"]]
            results[index] = {**per_epoch_verdict(expected, trained), "kills": [kill]}
    return results


def _done(root: Path, index: int) -> bool:
    return all((root / str(index) / f"rank{r}.json").exists() for r in range(2))


def _launch(root: Path, rows: list, name: str) -> dict:
    """One launch of 2 processes resuming ``rows`` in turn; ``{row: why the launch ended}``."""
    (root / "peers.json").write_text(json.dumps(rows))
    command = mp_harness.accelerate_command(HERE / "mp_rank.py", [root], world=2)
    launch = mp_harness.launch(command, root / name, timeout_s=TIMEOUT_S, stall_s=STALL_S)
    errors = launch.errors()
    why = (f"{errors[0]['traceback'].strip().splitlines()[-1][:100]} on rank {errors[0]['rank']}" if errors
           else f"{launch.watchdog or 'exit status ' + str(launch.returncodes)}")
    return {index: why for index in rows}
