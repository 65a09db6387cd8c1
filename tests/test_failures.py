"""Saves with no loader of this package, loaders left to Accelerate, the package's waits derived from the
collective timeout, and the one error every rank raises; in one process (``test_failures_mp.py`` runs the
same on 2 real processes)."""

from __future__ import annotations

import datetime
import json
import logging
from typing import Optional

import pytest
import torch
import torch.distributed as dist
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
from torch.utils.data import DataLoader, Sampler

import mp_harness
from accelerate_stateful import Accelerator
from accelerate_stateful._context import DistContext, collective_timeout, package_timeout
from accelerate_stateful.checkpoint import _files, _integrity
from accelerate_stateful.checkpoint._checkpoints import ENTRY_TIMEOUT_ENV, _shared_error, _verdict
from accelerate_stateful.checkpoint._versions import UnknownVersionError
from accelerate_stateful.errors import (
    CheckpointError, LifecycleError, Mismatch, StateMismatchError, StateSerializationError, UnsupportedConfigError,
)
from accelerate_stateful.loaders import _channels, _untracked

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def make(tmp_path, automatic: bool = False, dispatch: Optional[bool] = None) -> Accelerator:
    config = ProjectConfiguration(project_dir=str(tmp_path / "project"), automatic_checkpoint_naming=True)
    loaders = DataLoaderConfiguration(use_stateful_dataloader=True, dispatch_batches=dispatch)
    return Accelerator(cpu=True, dataloader_config=loaders, project_config=config if automatic else None)


def model_of(accelerator: Accelerator, weight: float) -> torch.nn.Module:
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(weight)
    return accelerator.prepare(model)


class Unsized(Sampler):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


# --------------------------------------------------------------------------- no loader of this package
def test_save_state_before_prepare_writes_accelerates_files_and_a_manifest_of_no_loaders(tmp_path):
    accelerator = make(tmp_path)
    path = accelerator.save_state(tmp_path / "explicit")
    manifest = _files.read_manifest(path)
    assert manifest["num_loaders"] == 0
    assert "random_states_0.pkl" in manifest["files"]
    accelerator.load_state(path)


def test_save_state_before_prepare_with_automatic_naming_is_complete_and_resume_before_prepare_says_when(tmp_path):
    first = make(tmp_path, automatic=True).save_state()
    assert first.name == "checkpoint_0" and _files.is_complete(first)
    with pytest.raises(LifecycleError, match=r"resume\(\) was called before accelerator.prepare\(\).*call it after"):
        make(tmp_path, automatic=True).resume()


def test_a_save_of_a_model_alone_is_resumed_with_its_weights(tmp_path):
    saver = make(tmp_path, automatic=True)
    model_of(saver, 3.0)
    saved = saver.save_state()
    resumer = make(tmp_path, automatic=True)
    model = model_of(resumer, 0.0)
    assert resumer.resume() == saved
    assert model.weight.item() == 3.0
    assert resumer.save_state().name == "checkpoint_1"


@pytest.mark.parametrize(
    "make_loader,why,dispatch",
    [
        pytest.param(lambda: DataLoader(list(range(8)), batch_size=None), "batch_size=None", None,
                     id="batch-size-none"),
        pytest.param(lambda: DataLoader(list(range(8)), batch_size=2, sampler=Unsized(8)), "Unsized has no len()",
                     None, id="unsized-sampler"),
        # issue 25, item 11: refused under the dispatcher, which Accelerate's own runs
        pytest.param(lambda: DataLoader(list(range(8)), batch_size=2, sampler=Unsized(8)), "Unsized has no len()",
                     True, id="unsized-sampler-dispatched"),
    ],
)
def test_a_loader_without_a_position_is_left_to_accelerate_with_a_warning_and_resumes_as_accelerate_does(
        tmp_path, caplog, make_loader, why, dispatch):
    accelerator = make(tmp_path, automatic=True, dispatch=dispatch)
    with caplog.at_level(logging.WARNING, logger=_untracked.__name__):
        dl = accelerator.prepare(make_loader())
    assert not accelerator.stateful_loaders
    assert "does not record the position of this DataLoader" in caplog.text and why in caplog.text
    it = iter(dl)
    next(it), next(it)
    path = accelerator.save_state()
    rest = list(it)
    assert _files.read_manifest(path)["num_loaders"] == 0

    again = make(tmp_path, automatic=True, dispatch=dispatch)
    dl = again.prepare(make_loader())
    assert again.resume() == path
    assert [torch.as_tensor(b).tolist() for b in dl] == [torch.as_tensor(b).tolist() for b in rest]


def test_a_loader_of_single_samples_is_refused_on_more_than_one_process_with_the_fix():
    with pytest.raises(UnsupportedConfigError, match="cannot be sharded over 2 processes.*pass batch_size="):
        _untracked.leave_to_accelerate(DataLoader(list(range(8)), batch_size=None), DistContext(0, 2))


# --------------------------------------------------------------------------- waits from the collective timeout
@pytest.fixture
def group_of_one():
    store = dist.TCPStore("127.0.0.1", mp_harness.free_port(), 1, True, timeout=datetime.timedelta(seconds=40))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=40))
    yield


def test_without_a_process_group_the_worker_reply_wait_is_its_default():
    assert collective_timeout() is None
    assert _channels.reply_timeout() == _channels.REPLY_TIMEOUT_S


def test_every_wait_of_the_package_is_half_the_collective_timeout(group_of_one):
    assert collective_timeout() == 40
    assert package_timeout(ENTRY_TIMEOUT_ENV, 60) == 20
    assert _channels.reply_timeout() == 20


def test_an_environment_variable_may_shorten_a_wait(group_of_one, monkeypatch):
    monkeypatch.setenv(_channels.REPLY_TIMEOUT_ENV, "5")
    assert _channels.reply_timeout() == 5


@pytest.mark.parametrize("value", ["20", "300", "0", "soon"])
def test_a_wait_that_would_outlast_half_the_collective_timeout_is_refused_with_the_fix(group_of_one, monkeypatch,
                                                                                        value):
    monkeypatch.setenv(ENTRY_TIMEOUT_ENV, value)
    with pytest.raises(UnsupportedConfigError, match=r"below half of the process group's collective timeout \(40 s\)"
                                                     r".*InitProcessGroupKwargs"):
        package_timeout(ENTRY_TIMEOUT_ENV, 60)


# --------------------------------------------------------------------------- the one error of every rank
def shared(*failures: Exception) -> Exception:
    return _shared_error([(rank, _verdict(exc)) for rank, exc in enumerate(failures, start=1)])


def test_the_error_every_rank_raises_keeps_the_class_and_fields_of_the_packages_own():
    mismatch = StateMismatchError([Mismatch("batch_size", 2, 4)], "pass the same batch_size")
    error = shared(mismatch)
    assert type(error) is StateMismatchError
    assert error.mismatches == mismatch.mismatches
    assert str(error) == f"rank 1 failed: {mismatch}"
    assert type(shared(UnknownVersionError("newer"))) is UnknownVersionError
    assert shared(StateSerializationError("no", "base/x")).path == "base/x"


def test_a_foreign_error_becomes_its_nearest_built_in_class_on_every_rank():
    class SafetensorLike(RuntimeError):
        pass

    error = shared(SafetensorLike("header too large"))
    assert type(error) is RuntimeError
    assert str(error) == "rank 1 failed (SafetensorLike): header too large"
    assert type(shared(KeyError("k"))) is LookupError
    assert type(shared(FileNotFoundError(2, "gone"))) is FileNotFoundError


def test_every_failing_rank_is_named_and_the_lowest_decides_the_class():
    error = shared(ValueError("first"), TypeError("second"))
    assert type(error) is ValueError
    assert str(error) == "rank 1 failed: first\nrank 2 failed too (TypeError): second"


def test_a_manifest_entry_that_is_not_a_size_and_hash_is_refused_as_damaged(tmp_path):
    path = make(tmp_path).save_state(tmp_path / "saved")
    manifest_path = path / _files.SUBDIR / _files.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["files"] = {rel: 5 for rel in manifest["files"]}
    manifest[_integrity.CHECKSUM] = _integrity.checksum(manifest)  # consistent, as a faulty writer's would be
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"MANIFEST.json is damaged .*are not \{'size': int, 'sha256': str\}"):
        _files.load_manifest(path)
