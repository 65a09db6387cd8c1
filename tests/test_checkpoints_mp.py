"""Checkpoint handling with 2 real processes (gloo): folders the ranks do not share, a save called on the
main process only, and launches that always end.

One job of 2 simulated nodes (two launchers of 1 process each, on this host) runs every scenario of
``mp_checkpoints.py``; the soak runs a few launches of ``mp_soak.py`` (``make soak`` runs 100).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import mp_harness
import soak
from mp_checkpoints import SCENARIOS

SCRIPT = Path(__file__).with_name("mp_checkpoints.py")
ENTRY_TIMEOUT_S = 3
# gloo's own collective timeout is 30 min; a save on one process used to wait for all of it.
LAUNCH_TIMEOUT_S = 120


def _two_nodes(out: Path) -> mp_harness.Launch:
    """Two launchers, one per simulated node, each starting 1 process: node-local folders on one host."""
    port = mp_harness.free_port()
    commands = [mp_harness.accelerate_command(SCRIPT, [out], 2, port=port, node=(node, 2)) for node in range(2)]
    return mp_harness.launch(commands, out / "launch", timeout_s=LAUNCH_TIMEOUT_S, watch=[out],
                             ACCELERATE_STATEFUL_ENTRY_TIMEOUT=str(ENTRY_TIMEOUT_S))


@pytest.mark.multiprocess
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_node_local_folders_resume_on_2_nodes_and_a_main_only_save_fails_fast(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    done = _two_nodes(out)
    print(f"the launch ended after {done.seconds:.1f} s with status {done.returncodes}")
    output = done.report()

    failures = []
    for rank in range(2):
        path = out / f"rank{rank}.json"
        results = json.loads(path.read_text()) if path.exists() else []
        ran = [r["id"] for r in results]
        if ran != [*SCENARIOS, "main-only-save"]:
            failures.append(f"rank {rank} ran {ran}")
        failures += [f"{r['id']} on rank {rank}: {r['detail']}" for r in results if not r["passed"]]
    assert not failures, "\n\n".join(failures) + f"\n\n{output}"
    # The mistake of the last scenario ends the job with the fix, not at the collective timeout.
    assert not done.hung and done.returncodes[0] != 0, output
    assert "accelerator.save_state() was called on rank 0, but rank(s) [1] did not call it" in output, output
    assert "call accelerator.save_state() on every process" in output


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_every_launch_of_a_short_training_ends(tmp_path):
    """A few launches of a 2-process training with workers and checkpoints (``make soak`` runs 100)."""
    results = soak.soak(launches=2, out=tmp_path, kind="exit", timeout_s=120, budget_s=180)
    report = "\n\n".join(Path(r.folder, "report.txt").read_text() for r in results if not r.ok)
    print("\n".join(f"launch {r.index}: {r.seconds} s, status {r.returncode}, in {r.folder}" for r in results))
    assert results and all(r.ok for r in results), report
