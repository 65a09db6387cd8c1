"""Issue 26: ``checkpoint-N`` folders past the step a Trainer run starts at are moved aside, whole, before it.

A real ``transformers.Trainer`` and ``StatefulTrainer`` on a tiny GPT-2 built from a config (CPU, nothing
downloaded), with the helpers of ``test_stock_checkpoints``.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from accelerate_stateful import CheckpointError
from accelerate_stateful.checkpoint import _files
from test_stock_checkpoints import _fingerprint, _recording, _trainer, _weights


def _classes():
    from transformers import Trainer

    from accelerate_stateful.transformers import stateful

    return _recording(Trainer), stateful(_recording(Trainer))


def _listing(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir())


def _superseded(out: Path) -> Path:
    (folder,) = out.glob("superseded-*")
    return folder


def _moved_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "superseded-" in r.getMessage()]


def test_resuming_below_a_stock_checkpoint_moves_it_aside_whole_and_trains_to_the_end(tmp_path, caplog):
    stock, ours = _classes()
    steps = {"max_steps": 28, "save_steps": 4}
    out = tmp_path / "run"
    _trainer(stock, out, [], stop_at=25, save_total_limit=2, **steps).train()  # stock: checkpoint-20, -24
    assert _listing(out) == ["checkpoint-20", "checkpoint-24"]
    before = {name: _fingerprint(out / name) for name in _listing(out)}
    clean = tmp_path / "clean"  # the same resume where no stock checkpoint-24 stands in the way
    shutil.copytree(out / "checkpoint-20", clean / "checkpoint-20")
    reference = []
    uninterrupted = _trainer(ours, clean, reference, **steps)
    uninterrupted.train(resume_from_checkpoint=str(clean / "checkpoint-20"))

    seen = []
    resumed = _trainer(ours, out, seen, **steps)
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=str(out / "checkpoint-20"))
    assert resumed.state.global_step == 28 and len(seen) == 8 and seen == reference
    assert torch.equal(_weights(resumed), _weights(uninterrupted))
    aside = _superseded(out)
    assert _listing(out) == ["checkpoint-20", "checkpoint-24", "checkpoint-28", aside.name]
    assert _listing(aside) == ["checkpoint-24"] and _fingerprint(aside / "checkpoint-24") == before["checkpoint-24"]
    assert _fingerprint(out / "checkpoint-20") == before["checkpoint-20"]
    assert _files.is_complete(out / "checkpoint-24") and _files.is_complete(out / "checkpoint-28")
    (line,) = _moved_lines(caplog)
    assert f"moved checkpoint-24 (stock transformers.Trainer) from {out} into {aside}" in line
    assert "past step 20" in line and f'resume_from_checkpoint="{aside / "checkpoint-24"}"' in line


def test_our_own_checkpoints_past_the_resumed_step_are_moved_aside_and_never_outrank_the_new_ones(tmp_path):
    from transformers import TrainerCallback

    _, ours = _classes()
    out = tmp_path / "run"
    first = _trainer(ours, out, [])
    first.train()  # ours: checkpoint-3, -6, -9, -10
    before = _fingerprint(out)
    (out / "checkpoint-8" / _files.SUBDIR).mkdir(parents=True)  # a killed save's leftover: ours, incomplete
    listings = []

    class Listing(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            listings.append([name for name in _listing(out) if name.startswith("checkpoint-")])

    resumed = _trainer(ours, out, [], save_total_limit=1)
    resumed.add_callback(Listing())
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    # Each save is the newest checkpoint-N present, so save_total_limit=1 keeps it and removes the older ones.
    assert listings == [["checkpoint-6", "checkpoint-8"], ["checkpoint-9"], ["checkpoint-10"]]
    assert torch.equal(_weights(resumed), _weights(first))
    assert _fingerprint(_superseded(out)) == {k: v for k, v in before.items() if not k.startswith("checkpoint-3/")}


def test_a_fresh_start_moves_every_foreign_checkpoint_aside_with_save_only_model(tmp_path, caplog):
    stock, ours = _classes()
    out = tmp_path / "run"
    _trainer(stock, out, [], stop_at=7, save_only_model=True).train()  # stock: checkpoint-3, -6
    (out / "checkpoint-9").mkdir()  # a stock save killed before its trainer_state.json
    (out / "checkpoint-9" / "model.safetensors").write_bytes(b"half")
    before = _fingerprint(out)
    fresh = _trainer(ours, out, [], save_only_model=True)
    with caplog.at_level(logging.WARNING):
        fresh.train()
    assert fresh.state.global_step == 10
    aside = _superseded(out)
    assert _listing(out) == ["checkpoint-10", "checkpoint-3", "checkpoint-6", "checkpoint-9", aside.name]
    assert _fingerprint(aside) == before
    assert all(_files.is_complete(out / f"checkpoint-{n}") for n in (3, 6, 9, 10))
    (line,) = _moved_lines(caplog)
    assert ("checkpoint-3 (stock transformers.Trainer), checkpoint-6 (stock transformers.Trainer), checkpoint-9 "
            "(not written by accelerate-stateful)") in line and "(a fresh start)" in line


def test_with_save_strategy_no_the_checkpoints_ahead_stay_where_they_are(tmp_path):
    stock, ours = _classes()
    out = tmp_path / "run"
    _trainer(stock, out, [], stop_at=7).train()  # stock: checkpoint-3, -6
    before = _fingerprint(out)
    fresh = _trainer(ours, out, [], save_strategy="no")
    fresh.train()
    assert fresh.state.global_step == 10 and _fingerprint(out) == before


def test_a_folder_that_cannot_be_moved_refuses_the_run_before_the_first_step_with_every_folder_in_place(
        tmp_path, monkeypatch):
    stock, ours = _classes()
    out = tmp_path / "run"
    _trainer(stock, out, []).train()  # stock: checkpoint-3, -6, -9, -10
    before = _fingerprint(out)
    rename = Path.rename

    def refused(self, target):  # what a folder without write permission does (the suite may run as root)
        if self.name == "checkpoint-9":
            raise PermissionError(13, "Permission denied", str(self))
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", refused)
    seen = []
    resumed = _trainer(ours, out, seen)
    refusal = (r"cannot start training at step 3: .* holds checkpoint-6, checkpoint-9, checkpoint-10, .*moving "
               r"checkpoint-9 aside .*\(Permission denied\); nothing was moved\. Give this process write permission")
    with pytest.raises(CheckpointError, match=refusal):
        resumed.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    assert seen == [] and _fingerprint(out) == before
    assert _listing(out) == ["checkpoint-10", "checkpoint-3", "checkpoint-6", "checkpoint-9"]
