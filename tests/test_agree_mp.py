"""Whatever defines the data is agreed once, on every rank, on 2 real processes (gloo): a per-rank generator
seed, weights set on one rank, a reader's error under the dispatcher. One launch runs every scenario of
``mp_agree.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import mp_harness
from mp_agree import SCENARIOS

SCRIPT = Path(__file__).with_name("mp_agree.py")
LAUNCH_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("agree")
    done = mp_harness.launch(mp_harness.accelerate_command(SCRIPT, [out]), out / "launch", timeout_s=LAUNCH_TIMEOUT_S,
                             collective_timeout_s=60, watch=[out])
    results = {}
    for rank in range(2):
        path = out / f"rank{rank}.json"
        results[rank] = {r["id"]: r for r in json.loads(path.read_text())} if path.exists() else {}
    return results, done.report()


@pytest.mark.multiprocess
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_what_defines_the_data_is_agreed_on_both_ranks(launched, scenario):
    results, output = launched
    for rank in range(2):
        found = results[rank].get(scenario)
        assert found is not None, f"rank {rank} did not run {scenario} (an earlier scenario raised?):\n{output}"
        assert found["passed"], f"{scenario} on rank {rank}: {found['detail']}\n{output}"
