"""Every file a checkpoint holds is hashed by its save, and nothing is called good that was not checked (issue 26).

A byte changed in the model, the manifest cut short or changed, a file added after the save: ``verify`` and
``load_state`` name the problem and the fix. A checkpoint of an earlier release, whose manifest hashed only the
package's own files, still loads, and ``verify`` says which files it could check for their size only.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader

from accelerate_stateful import Accelerator
from accelerate_stateful.checkpoint import _files, _integrity
from accelerate_stateful.cli._main import PROBLEMS, SIZE_ONLY, main
from accelerate_stateful.errors import CheckpointError

MANIFEST = Path(_files.SUBDIR) / _files.MANIFEST


class Counter:
    """A custom object registered for checkpointing: Accelerate writes it to ``custom_checkpoint_0.pkl``."""

    def __init__(self) -> None:
        self.count = 7

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


@pytest.fixture(scope="module")
def accelerator() -> Accelerator:
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    accelerator.prepare(model, optimizer, scheduler, DataLoader(list(range(16)), batch_size=4))
    accelerator.register_for_checkpointing(Counter())
    return accelerator


@pytest.fixture(scope="module")
def saved(accelerator, tmp_path_factory) -> Path:
    return accelerator.save_state(tmp_path_factory.mktemp("saved") / "ckpt")


@pytest.fixture
def ckpt(saved, tmp_path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "ckpt"))


def flip(path: Path, offset: int = -3) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    path.write_bytes(bytes(data))


def verify(ckpt: Path, capsys) -> tuple[int, str]:
    status = main(["verify", str(ckpt)])
    captured = capsys.readouterr()
    return status, captured.out + captured.err


def test_the_manifest_lists_every_file_of_the_save_with_its_size_and_hash(saved):
    manifest = json.loads((saved / MANIFEST).read_text())
    on_disk = {p.relative_to(saved).as_posix() for p in saved.rglob("*") if p.is_file()} - {MANIFEST.as_posix()}
    assert set(manifest["files"]) == on_disk
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "custom_checkpoint_0.pkl"} <= on_disk
    for rel, entry in manifest["files"].items():
        assert entry == {"size": (saved / rel).stat().st_size, "sha256": _integrity.sha256_file(saved / rel)}, rel


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.bin", "scheduler.bin", "custom_checkpoint_0.pkl",
                                  "random_states_0.pkl"])
def test_verify_refuses_a_file_with_one_byte_changed_and_its_size_unchanged(ckpt, capsys, name):
    flip(ckpt / name)
    status, out = verify(ckpt, capsys)
    assert status == PROBLEMS
    assert f"PROBLEM {name}: " in out and "does not match the hash in its manifest" in out and "OK" not in out


def test_load_state_refuses_a_model_with_one_byte_changed_before_loading_anything(accelerator, ckpt):
    flip(ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.safetensors does not match the hash .*resume from another"):
        accelerator.load_state(ckpt)


@pytest.mark.parametrize("where", ["extra.bin", "sub/notes.txt"])
def test_verify_and_load_state_refuse_a_file_added_after_the_save_anywhere_in_the_checkpoint(accelerator, ckpt,
                                                                                             capsys, where):
    (ckpt / where).parent.mkdir(exist_ok=True)
    (ckpt / where).write_text("added later")
    status, out = verify(ckpt, capsys)
    assert status == PROBLEMS and f"PROBLEM {where}: " in out and "is not listed in the manifest" in out
    with pytest.raises(CheckpointError, match=f"{where} is not listed in the manifest"):
        accelerator.load_state(ckpt)


def _as_written_by_an_earlier_release(ckpt: Path) -> None:
    """Hashes of the package's own files only, and no checksum of the manifest: what earlier releases wrote."""
    manifest = json.loads((ckpt / MANIFEST).read_text())
    del manifest[_integrity.CHECKSUM]
    for rel, entry in manifest["files"].items():
        if not rel.startswith(f"{_files.SUBDIR}/"):
            del entry["sha256"]
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


def test_verify_never_calls_good_the_files_an_earlier_release_did_not_hash(accelerator, ckpt, capsys):
    _as_written_by_an_earlier_release(ckpt)
    status, out = verify(ckpt, capsys)
    assert status == SIZE_ONLY and not out.startswith("OK")
    assert "UNCHECKED model.safetensors: its size matches" in out
    assert "could only be checked for their size: not hashed by the version that wrote it" in out
    accelerator.load_state(ckpt)  # still loads: its sizes and the package's own hashes match


def test_a_truncated_manifest_is_named_as_cut_short_without_a_raw_json_error(accelerator, ckpt, capsys):
    data = (ckpt / MANIFEST).read_bytes()
    (ckpt / MANIFEST).write_bytes(data[: len(data) // 2])
    status, out = verify(ckpt, capsys)
    assert status == PROBLEMS and "JSONDecodeError" not in out
    assert f"MANIFEST.json is damaged: it ends after {len(data) // 2} bytes, in the middle of its content" in out
    with pytest.raises(CheckpointError, match=r"MANIFEST.json is damaged: it ends after .*resume from an earlier"):
        accelerator.load_state(ckpt)


def test_a_changed_byte_in_the_manifest_is_named_as_a_changed_manifest(accelerator, ckpt, capsys):
    data = (ckpt / MANIFEST).read_bytes()
    flip(ckpt / MANIFEST, data.index(b"SAVE_STARTED") + 3)  # the byte the issue flipped
    status, out = verify(ckpt, capsys)
    assert status == PROBLEMS
    assert out.startswith(f"PROBLEM {MANIFEST.as_posix()}: ") and "MANIFEST.json was changed after the save" in out
    with pytest.raises(CheckpointError, match=r"MANIFEST.json was changed after the save: .*checksum"):
        accelerator.load_state(ckpt)


def test_load_state_of_a_folder_that_does_not_exist_says_so_and_not_that_a_save_was_interrupted(accelerator,
                                                                                                   tmp_path):
    with pytest.raises(CheckpointError, match=r"nope does not exist: check the path") as caught:
        accelerator.load_state(tmp_path / "nope")
    assert "interrupted" not in str(caught.value)


def test_processes_sharing_a_folder_hash_every_file_exactly_once_the_largest_spread_first():
    sizes = {"model": 900, "optimizer": 800, "a": 10, "b": 10, "c": 5}
    shares = [_integrity.share(sizes, sizes, index, 3) for index in range(3)]
    assert shares == [["model"], ["optimizer"], ["a", "b", "c"]]
    assert _integrity.share(sizes, sizes, 0, 1) == sorted(sizes)


def test_the_trainer_refuses_a_checkpoint_whose_model_changed_before_loading_it(tmp_path, fresh_accelerate_state):
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from accelerate_stateful.transformers import StatefulTrainer

    def trainer(steps: int) -> StatefulTrainer:
        model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1))
        args = TrainingArguments(str(tmp_path), report_to=[], use_cpu=True, max_steps=steps, save_steps=1)
        return StatefulTrainer(model=model, args=args, train_dataset=[{"input_ids": [1, 2], "labels": [1, 2]}] * 4)

    trainer(1).train()
    flip(tmp_path / "checkpoint-1" / "model.safetensors")
    fresh_accelerate_state._reset_state(True)
    with pytest.raises(CheckpointError, match=r"checkpoint-1/model.safetensors does not match the hash"):
        trainer(2).train(resume_from_checkpoint=True)
    assert not (tmp_path / "checkpoint-2").exists()  # nothing was trained or saved
