"""Checkpoint folders, DCP and the Trainer's clean-up decide the same on every rank (issue 25, items 7-10).

In one process: a folder saved into again is unsealed before it changes. With real processes (one torchrun
launch of ``rank_agreement_ckpt.py``): a refusal on one rank raises on every rank, and the distributed context
follows the process group.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader

from accelerate_stateful import Accelerator, CheckpointError
from accelerate_stateful.checkpoint import _files
from accelerate_stateful.checkpoint import _ownership
from accelerate_stateful.integrations.transformers import StatefulTrainerMixin
from cli_run import run_cli
import mp_harness

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

SCENARIOS = Path(__file__).with_name("rank_agreement_ckpt.py")


def start() -> tuple[Accelerator, torch.nn.Module, object]:
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = DataLoader(torch.arange(16.0), batch_size=2)
    model, optimizer, dl = accelerator.prepare(model, optimizer, dl)
    return accelerator, model, iter(dl)


def step(model: torch.nn.Module, batches) -> None:
    with torch.no_grad():
        model.weight += next(batches).sum()


# --------------------------------------------------------------------------- item 7: one process
def test_a_save_into_a_sealed_folder_killed_while_writing_leaves_it_incomplete(tmp_path, monkeypatch):
    accelerator, model, batches = start()
    latest = tmp_path / "latest"
    step(model, batches)
    accelerator.save_state(latest)
    step(model, batches)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed while writing the loader states")

    monkeypatch.setattr(_files, "write_encoded", killed)
    with pytest.raises(KeyboardInterrupt):
        accelerator.save_state(latest)  # the new weights are on disk, the old loader states still there
    monkeypatch.undo()
    del batches
    assert not _files.has_manifest(latest)
    with pytest.raises(CheckpointError, match=r"latest is incomplete: it has no accelerate_stateful/MANIFEST.json"):
        accelerator.load_state(latest)
    status, out, err = run_cli("verify", latest)
    assert status == 1 and f"{latest} is incomplete" in out + err, out + err


def test_a_save_into_a_sealed_folder_that_ends_is_sealed_again_and_loads(tmp_path):
    accelerator, model, batches = start()
    latest = tmp_path / "latest"
    accelerator.save_state(latest)
    step(model, batches)
    accelerator.save_state(latest)
    del batches
    accelerator.load_state(latest)
    assert _files.is_complete(latest)


# --------------------------------------------------------------------------- item 10: one process
def test_the_trainer_clean_up_keeps_a_complete_checkpoint_and_removes_an_unfinished_one(tmp_path):
    complete, unfinished = tmp_path / "checkpoint-4", tmp_path / "checkpoint-6"
    for folder in (complete, unfinished):
        _ownership.write_marker(folder)
        (folder / "model.safetensors").write_bytes(b"weights")
    _files.write_manifest(complete, world_size=1, num_loaders=0)
    trainer = SimpleNamespace(accelerator=SimpleNamespace(is_main_process=True, wait_for_everyone=lambda: None))

    StatefulTrainerMixin._clear_leftover(trainer, complete)
    StatefulTrainerMixin._clear_leftover(trainer, unfinished)
    assert (complete / "model.safetensors").read_bytes() == b"weights" and not _files.has_manifest(complete)
    assert not (unfinished / "model.safetensors").exists() and _ownership.marker(unfinished).is_file()


# --------------------------------------------------------------------------- items 8-10: two real processes
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_refusals_on_one_rank_raise_on_every_rank_and_the_context_follows_the_process_group(tmp_path):
    done = mp_harness.launch(mp_harness.torchrun_command(SCENARIOS, [tmp_path]), tmp_path / "launch", timeout_s=150,
                             collective_timeout_s=60, watch=[tmp_path])
    print(f"torchrun, 2 ranks: {done.seconds:.1f} s")
    results = [json.loads(p.read_text()) for p in (tmp_path / f"rank{r}.json" for r in range(2)) if p.exists()]
    assert done.ok and len(results) == 2, done.report()
    failures = [f"rank {r}: {f}" for r, result in enumerate(results) for f in result["failures"]]
    assert not failures, "\n".join(failures)
    assert results[0]["checks"] == results[1]["checks"] and len(results[0]["checks"]) >= 6, results
