"""The published resume-correctness table cannot go stale silently: the suite measures a quick subset of it
(benchmarks/conformance, ``run.py --quick``) and compares every loader's verdicts with the committed
``expected.json``, keyed by the releases it was measured with. A new release of a peer, or a change in ours,
that changes a cell fails here until ``make conformance`` re-measures the table and the change is committed.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "benchmarks" / "conformance"
sys.path.insert(0, str(HARNESS))

import peers_streaming  # noqa: E402
from scenarios import per_epoch_verdict, verdict  # noqa: E402


def differences(expected: dict, rows: dict) -> list[str]:
    """Each way the measured rows differ from the committed verdicts, in words."""
    found = []
    for name, row in rows.items():
        want = expected.get(name)
        if want is None:
            found.append(f"{name}: a row the committed table does not have")
            continue
        if row["versions"] != want["versions"]:
            found.append(f"{name}: installed releases {row['versions']}, the table was measured with "
                         f"{want['versions']}")
            continue
        for key, cell in row["cells"].items():
            measured = {k: v for k, v in cell.items() if k in ("verdict", "lost", "repeated", "order_differs")}
            if measured != want["cells"].get(key):
                found.append(f"{name}, {key}: now {measured}, the table says {want['cells'].get(key)}")
    return found


def test_a_resumed_run_is_judged_by_the_ids_lost_and_repeated():
    run = [(0, 0), (0, 1), (0, 2), (1, 2)]
    assert verdict(run, run) == {"verdict": "exact"}
    assert verdict(run, [(0, 0), (0, 1), (0, 1), (1, 2)]) == {
        "verdict": "wrong", "lost": 1, "repeated": 1, "order_differs": False}
    assert verdict(run, [(0, 1), (0, 0), (0, 2), (1, 2)])["order_differs"] is True
    assert per_epoch_verdict(run, [(0, 2), (0, 0), (0, 1), (1, 2)]) == {"verdict": "exact"}
    assert per_epoch_verdict(run, [(0, 0), (0, 1), (1, 2), (1, 2)]) == {"verdict": "wrong", "lost": 1, "repeated": 1}


def test_a_changed_cell_or_release_is_named_against_the_committed_table():
    expected = {"x": {"versions": {"x": "1.0"}, "cells": {"map-mid": {"verdict": "exact"}}}}
    same = {"x": {"versions": {"x": "1.0"}, "cells": {"map-mid": {"verdict": "exact", "kills": [4]}}}}
    assert differences(expected, same) == []
    changed = {"x": {"versions": {"x": "1.0"}, "cells": {"map-mid": {"verdict": "wrong", "lost": 1, "repeated": 0,
                                                                     "order_differs": False}}}}
    assert differences(expected, changed) == [
        "x, map-mid: now {'verdict': 'wrong', 'lost': 1, 'repeated': 0, 'order_differs': False}, "
        "the table says {'verdict': 'exact'}"]
    newer = {"x": {"versions": {"x": "2.0"}, "cells": {}}}
    assert "measured with {'x': '1.0'}" in differences(expected, newer)[0]


def test_every_process_finds_a_streaming_rows_data_at_the_path_the_first_one_wrote():
    # Each rank once wrote a private copy: litdata's writer then waited forever for the other rank's index,
    # and mosaicml-streaming (its ``_mds`` is written the same way; not imported here: seconds) refused ranks
    # whose ``local`` differ. A reload stands for another process: the module's state is gone.
    ids = [0, 1, 2]
    first = peers_streaming._chunks(ids)
    assert (Path(first) / "index.json").exists()
    assert importlib.reload(peers_streaming)._chunks(ids) == first
    assert peers_streaming._chunks(ids + [3]) != first


@pytest.mark.timeout(240)
def test_every_loaders_quick_verdicts_are_the_published_tables(tmp_path):
    out = tmp_path / "quick.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(HARNESS / "run.py"), "--quick", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text(encoding="utf-8"))["rows"]
    expected = json.loads((HARNESS / "expected.json").read_text(encoding="utf-8"))
    found = differences(expected, rows)
    assert not found, ("the resume-correctness table is stale (re-measure with `make conformance`, then commit "
                       "docs/benchmarks.md and benchmarks/conformance/expected.json):\n" + "\n".join(found))
