"""Checkpoint handling with 2 real processes (gloo): folders the ranks do not share, a save called on the
main process only, and launches that always end.

One job of 2 simulated nodes (two launchers of 1 process each, on this host) runs every scenario of
``mp_checkpoints.py``; the soak runs a few launches of ``mp_soak.py`` (``make soak`` runs 100).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import soak
from mp_checkpoints import SCENARIOS

SCRIPT = Path(__file__).with_name("mp_checkpoints.py")
ENTRY_TIMEOUT_S = 3
# gloo's own collective timeout is 30 min; a save on one process used to wait for all of it.
LAUNCH_TIMEOUT_S = 120


def _two_nodes(out: Path) -> list[subprocess.Popen]:
    """Two launchers, one per simulated node, each starting 1 process: node-local folders on one host."""
    env = soak.launch_env()
    env["ACCELERATE_STATEFUL_ENTRY_TIMEOUT"] = str(ENTRY_TIMEOUT_S)
    port = soak.free_port()
    procs = []
    for node in range(2):
        command = [
            sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "2",
            "--machine_rank", str(node), "--num_processes", "2", "--main_process_ip", "127.0.0.1",
            "--main_process_port", str(port), "--mixed_precision", "no", "--dynamo_backend", "no",
            "--num_cpu_threads_per_process", "1", str(SCRIPT), str(out),
        ]
        procs.append(subprocess.Popen(command, cwd=soak.ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
    return procs


def _wait(procs: list[subprocess.Popen]) -> tuple[list[int], str]:
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    outputs = []
    try:
        for proc in procs:
            output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(output)
    except subprocess.TimeoutExpired:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        text = "\n".join(p.communicate()[0] or "" for p in procs)
        pytest.fail(f"the launch hung: still running after {LAUNCH_TIMEOUT_S} s:\n{text[-5000:]}")
    return [p.returncode for p in procs], "\n".join(outputs)


@pytest.mark.multiprocess
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_node_local_folders_resume_on_2_nodes_and_a_main_only_save_fails_fast(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    started = time.monotonic()
    codes, output = _wait(_two_nodes(out))
    print(f"the launch ended after {time.monotonic() - started:.1f} s with status {codes}")

    failures = []
    for rank in range(2):
        path = out / f"rank{rank}.json"
        results = json.loads(path.read_text()) if path.exists() else []
        ran = [r["id"] for r in results]
        if ran != [*SCENARIOS, "main-only-save"]:
            failures.append(f"rank {rank} ran {ran}")
        failures += [f"{r['id']} on rank {rank}: {r['detail']}" for r in results if not r["passed"]]
    assert not failures, "\n\n".join(failures) + f"\n\nlaunch output (end):\n{output[-4000:]}"
    # The mistake of the last scenario ends the job with the fix, not at the collective timeout.
    assert codes[0] != 0, output[-4000:]
    assert "accelerator.save_state() was called on rank 0, but rank(s) [1] did not call it" in output, output[-4000:]
    assert "call accelerator.save_state() on every process" in output


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_every_launch_of_a_short_training_ends(tmp_path):
    """A few launches of a 2-process training with workers and checkpoints (``make soak`` runs 100)."""
    results = soak.soak(launches=2, out=tmp_path, hang_s=90, budget_s=180)
    report = "\n".join(f"launch {r.index}: {r.seconds} s, status {r.returncode}, log {r.log}" for r in results)
    print(report)
    hung = [r for r in results if r.hung]
    assert not hung, "hung:\n" + "\n\n".join(Path(r.log).read_text(errors="replace")[-4000:] for r in hung)
    assert all(r.returncode == 0 for r in results), report
    terminated = [r for r in results if r.terminate_message]
    assert not terminated, "\n\n".join(Path(r.log).read_text(errors="replace")[-4000:] for r in terminated)
