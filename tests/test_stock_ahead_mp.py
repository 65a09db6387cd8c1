"""Issue 26 on 2 real processes (gloo): checkpoint-N past the starting step are moved aside by the main process,
checked on both, and a move that fails there refuses the run on both, before the first step (``mp_stock_ahead.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import mp_harness
from mp_stock_ahead import stock_folders

SCRIPT = Path(__file__).with_name("mp_stock_ahead.py")
LAUNCH_TIMEOUT_S = 240


@pytest.mark.multiprocess
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_checkpoints_ahead_are_moved_once_for_every_rank_and_a_failed_move_refuses_on_every_rank(tmp_path):
    root = tmp_path / "runs"
    stock_folders(root / "refused")
    stock_folders(root / "moved")
    done = mp_harness.launch(mp_harness.accelerate_command(SCRIPT, [root]), tmp_path / "launch",
                             timeout_s=LAUNCH_TIMEOUT_S, watch=[root], HF_HOME=str(tmp_path / "hf_home"))
    assert done.ok, done.report()
    seen = [json.loads((root / f"rank{rank}.json").read_text()) for rank in range(2)]
    refusal = seen[0]["refused"]  # the main process's error, raised as such on both ranks
    assert seen[1]["refused"] == refusal and refusal.startswith("rank 0 failed: cannot start training at step 0: ")
    assert "moving checkpoint-6 aside" in refusal and "nothing was moved" in refusal
    assert sorted(p.name for p in (root / "refused").iterdir()) == ["checkpoint-3", "checkpoint-6"]
    (aside,) = (root / "moved").glob("superseded-*")
    expected = {"global_step": 4, "listing": ["checkpoint-3", "checkpoint-4"],
                "aside": [f"{aside.name}/checkpoint-3", f"{aside.name}/checkpoint-6"]}
    assert seen[0]["moved"] == seen[1]["moved"] == expected
    assert (aside / "checkpoint-6" / "model.safetensors").read_bytes() == b"stock weights 6"
