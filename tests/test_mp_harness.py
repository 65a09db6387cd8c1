"""The multi-process harness itself (``mp_harness.py``, ``mp_harness_rank.py``), on 2 real processes (gloo).

A launch forked from the pre-imported server (``mp_zygote``) starts its ranks as ``accelerate launch`` does. A
rank that raises ends both ranks, with its whole traceback in the report; a job that stops making progress is
ended by the watchdog, which first dumps the stack of every rank and of every DataLoader worker.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import mp_harness

PROBE = Path(__file__).with_name("mp_harness_probe.py")


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2])
def test_a_forked_launch_starts_its_ranks_as_accelerate_launch_does(tmp_path, monkeypatch, world):
    """The same command, started for real and forked: the same launcher variables (ports and run ids aside),
    script arguments and ``sys.path[0]``, a session per rank where torchrun makes one, numpy seeded apart."""
    seen = {}
    for how in ("exec", "fork"):
        monkeypatch.setenv(mp_harness.LAUNCH_ENV, how)
        out = tmp_path / how
        out.mkdir()
        command = mp_harness.accelerate_command(PROBE, ["env", out], world)
        assert mp_harness.forkable(command, mp_harness.launch_env()) == (how == "fork")
        done = mp_harness.launch(command, tmp_path / f"{how}.launch", timeout_s=90)
        assert done.ok, done.report()
        seen[how] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    numbers = [record["numpy"] for record in seen["fork"]]
    assert len(set(numbers)) == len(numbers), "forked ranks drew the same numpy numbers"
    for real, forked in zip(seen["exec"], seen["fork"]):
        for record in (real, forked):
            record["env"].pop("MASTER_PORT", None)
            record["env"].pop("TORCHELASTIC_RUN_ID", None)
            record["argv"][-1] = "OUT"  # the folder each writes to
            record.pop("numpy")
        assert forked == real


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_rank_that_raises_ends_every_rank_with_its_whole_traceback(tmp_path):
    # Without the fail-fast exit, rank 0 would wait in its barrier for the collective timeout (300 s).
    done = mp_harness.launch(mp_harness.accelerate_command(PROBE, ["raise"]), tmp_path / "launch",
                             timeout_s=90, stall_s=30, collective_timeout_s=300)
    report = done.report()
    print(report)
    assert not done.hung and done.returncode != 0, report
    first = done.errors()[0]
    assert first["rank"] == 1, report
    assert "rank_one_raises_here" in first["traceback"] and "in main" in first["traceback"], report
    assert "ValueError: rank 1 fails on purpose" in report and first["traceback"] in report
    assert not done.leftovers, report


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_watchdog_dumps_every_rank_and_worker_stack_before_killing_a_stuck_job(tmp_path):
    done = mp_harness.launch(mp_harness.accelerate_command(PROBE, ["block"]), tmp_path / "launch",
                             timeout_s=90, stall_s=4, collective_timeout_s=300)
    report = done.report()
    print(report)
    assert done.hung and "no output" in done.watchdog, report
    stacks = done.stacks
    assert "=== pid" in stacks and ", rank 0:" in stacks and ", rank 1:" in stacks, report
    assert "child of rank 1 (a DataLoader worker)" in stacks, report
    sections = {header.split(":")[0]: body for header, body in _sections(stacks)}
    rank0 = next(body for name, body in sections.items() if name.endswith("rank 0"))
    rank1 = next(body for name, body in sections.items() if name.endswith("rank 1"))
    worker = next(body for name, body in sections.items() if "worker" in name)
    assert "in main" in rank0 and "barrier" in rank0, report
    assert "rank_one_waits_here" in rank1, report
    assert "worker_blocks_here" in worker, report
    assert not any(p.is_running() for p in _processes(done)), "a process of the job outlived the watchdog"


def _sections(stacks: str) -> list[tuple[str, str]]:
    parts = stacks.split("\n=== ")[1:]
    return [(part.split(" ===\n", 1)[0], part.split(" ===\n", 1)[1] if " ===\n" in part else "") for part in parts]


def _processes(done: mp_harness.Launch) -> list:
    import psutil

    pids = [int(line.split()[2].rstrip(",")) for line in done.stacks.splitlines() if line.startswith("=== pid")]
    found = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            if process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except psutil.NoSuchProcess:
            pass
    return found
