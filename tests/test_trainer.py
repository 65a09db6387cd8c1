"""The Trainer integration in one process: what it relies on inside transformers, which checkpoint it picks,
``stateful()``, preemption signals, and a hand-written loop preempted and resumed (real files, real signals)."""

from __future__ import annotations

import inspect
import os
import signal

import pytest
import torch
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
from torch.utils.data import DataLoader

import accelerate_stateful
import accelerate_stateful.integrations.transformers as integration
from accelerate_stateful import PREEMPTED_EXIT_CODE, Accelerator, UnsupportedConfigError
from accelerate_stateful.checkpoint import _files
from accelerate_stateful.checkpoint import _ownership
from accelerate_stateful.training._preemption import PreemptionRequest
from accelerate_stateful.integrations.transformers import StatefulTrainer, check_transformers, latest_trainer_checkpoint, stateful


def test_the_installed_transformers_has_everything_the_integration_relies_on():
    # Fails on a transformers release that renames or re-signs what StatefulTrainer overrides or swaps.
    check_transformers()


@pytest.mark.parametrize("target", ["module name", "method", "parameter"])
def test_a_transformers_without_what_it_relies_on_is_refused_naming_the_supported_versions(target, monkeypatch):
    if target == "module name":
        monkeypatch.delattr(integration.hf_trainer, "skip_first_batches")
    elif target == "method":
        monkeypatch.delattr(integration.Trainer, "_run_epoch")
    else:
        monkeypatch.setattr(integration.Trainer, "_init_training_state", lambda self, max_steps, trial: None)
    with pytest.raises(UnsupportedConfigError, match=r"supports transformers >= 5\.3, < 6.*Install a supported"):
        check_transformers()


def _checkpoint(root, step, complete):
    folder = root / f"checkpoint-{step}"
    _ownership.write_marker(folder)  # what a save of this package writes first
    (folder / "trainer_state.json").write_text("{}")
    if complete:
        _files.write_manifest(folder, world_size=1, num_loaders=0)
    return folder


def test_the_newest_complete_checkpoint_is_chosen_never_one_whose_save_was_cut_short(tmp_path):
    from transformers.trainer_utils import get_last_checkpoint

    _checkpoint(tmp_path, 5, complete=True)
    newest = _checkpoint(tmp_path, 20, complete=True)
    _checkpoint(tmp_path, 25, complete=False)
    (tmp_path / "checkpoint-30").mkdir()  # killed before anything was written
    (tmp_path / "checkpoint-x").mkdir()
    assert latest_trainer_checkpoint(tmp_path) == newest
    # Stock Trainer takes the highest number, complete or not (and then fails on its missing files).
    assert get_last_checkpoint(str(tmp_path)).endswith("checkpoint-30")
    (newest / "trainer_state.json").write_text("{}{}")  # a file changed after the save: no longer complete
    assert latest_trainer_checkpoint(tmp_path).name == "checkpoint-5"
    assert latest_trainer_checkpoint(tmp_path / "missing") is None


def test_stateful_subclasses_any_trainer_once_and_refuses_other_classes():
    from trl import SFTTrainer

    made = stateful(SFTTrainer)
    assert issubclass(made, SFTTrainer) and issubclass(made, integration.StatefulTrainerMixin)
    assert stateful(SFTTrainer) is made and stateful(made) is made
    assert stateful(integration.Trainer) is StatefulTrainer
    with pytest.raises(TypeError, match="transformers.Trainer subclass"):
        stateful(torch.nn.Module)


def test_a_signal_is_recorded_and_agreed_and_the_previous_handlers_come_back():
    before = signal.getsignal(signal.SIGUSR1)
    request = PreemptionRequest().install()
    try:
        assert not request.poll()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert request.received == signal.SIGUSR1 and request.poll()
    finally:
        request.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is before


def _loop(project, data, seen, interrupt_after=None, epochs=2):
    """A hand-written loop with the one-line opt-in; appends each batch's ids and loss to ``seen``."""
    accelerator = Accelerator(
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True, data_seed=1),
        project_config=ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True),
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(data, batch_size=3, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    accelerator.resume()
    accelerator.checkpoint_on_preemption()
    for _ in range(loader.epoch, epochs):
        for batch in loader:
            loss = (model(batch.float().unsqueeze(1)) ** 2).mean()
            accelerator.backward(loss)
            seen.append((batch.tolist(), loss.item()))  # logged before the step: a preempted step's log is kept
            if len(seen) == interrupt_after:
                os.kill(os.getpid(), signal.SIGTERM)
            optimizer.step()  # with a signal: the checkpoint is taken here, at the end of this step, then exit
            optimizer.zero_grad()


def test_a_preempted_hand_written_loop_saves_at_the_end_of_the_step_exits_143_and_resumes_exactly(
        tmp_path, fresh_accelerate_state):
    data = list(range(20))
    previous = signal.getsignal(signal.SIGTERM)
    reference, seen = [], []
    _loop(tmp_path / "ref", data, reference)
    fresh_accelerate_state._reset_state(True)
    try:
        with pytest.raises(SystemExit) as stopped:
            _loop(tmp_path / "run", data, seen, interrupt_after=5)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.code == PREEMPTED_EXIT_CODE
    # Saved at the end of step 5's optimizer step, before anything of step 6 was read.
    assert [p.name for p in _files.complete_checkpoints(tmp_path / "run" / "checkpoints")] == ["checkpoint_0"]
    fresh_accelerate_state._reset_state(True)
    _loop(tmp_path / "run", data, seen)
    assert seen == reference


def test_preemption_needs_automatic_checkpoint_naming_a_prepared_loader_and_a_prepared_optimizer(tmp_path, fresh_accelerate_state):
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    with pytest.raises(UnsupportedConfigError, match="automatic_checkpoint_naming=True"):
        accelerator.checkpoint_on_preemption()
    fresh_accelerate_state._reset_state(True)
    accelerator = Accelerator(
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
        project_config=ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True),
    )
    with pytest.raises(UnsupportedConfigError, match="after accelerator.prepare"):
        accelerator.checkpoint_on_preemption()
    accelerator.prepare(DataLoader(list(range(4)), batch_size=2))
    with pytest.raises(UnsupportedConfigError, match="no prepared optimizer; prepare the optimizer"):
        accelerator.checkpoint_on_preemption()


def test_the_public_names_of_the_integration():
    assert sorted(integration.__all__) == integration.__all__
    assert "PREEMPTED_EXIT_CODE" in accelerate_stateful.__all__
    assert inspect.signature(StatefulTrainer.train).parameters["resume_from_checkpoint"].default is None


def test_a_resumed_stream_reads_nothing_before_its_position_where_stock_trainer_reads_all_of_it(
        tmp_path, fresh_accelerate_state):
    from scripts import load_script

    bench = load_script("benchmarks/bench_trainer.py", "bench_trainer")
    items, batch = 40, 4
    # Ours: the first step's batch and one batch of look-ahead, wherever the position is.
    for fraction in (0.2, 0.8):
        assert bench.resume_time("ours", tmp_path, items, batch, fraction)[1] == 2 * batch
    # Stock Trainer (skip_first_batches): every item up to the position is produced again and thrown away.
    assert bench.resume_time("stock", tmp_path, items, batch, 0.8)[1] == 32 + 2 * batch


def _tiny_trainer(tmp_path, **settings):
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1))
    args = TrainingArguments(str(tmp_path), report_to=[], use_cpu=True, max_steps=1, **settings)
    return StatefulTrainer(model=model, args=args, train_dataset=[{"input_ids": [1, 2]}] * 4)


def test_what_cannot_be_resumed_exactly_is_refused_before_anything_is_trained(tmp_path, fresh_accelerate_state):
    with pytest.raises(UnsupportedConfigError, match="enable_jit_checkpoint=True .* drop it"):
        _tiny_trainer(tmp_path, enable_jit_checkpoint=True)
    fresh_accelerate_state._reset_state(True)
    with pytest.raises(UnsupportedConfigError, match="ignore_data_skip=True .* drop ignore_data_skip"):
        _tiny_trainer(tmp_path, ignore_data_skip=True).train(resume_from_checkpoint=True)
    fresh_accelerate_state._reset_state(True)
    unfinished = _checkpoint(tmp_path, 3, complete=False)
    with pytest.raises(accelerate_stateful.CheckpointError, match="checkpoint-3 is incomplete"):
        _tiny_trainer(tmp_path).train(resume_from_checkpoint=str(unfinished))
    assert not (tmp_path / "checkpoint-1").exists()  # nothing was trained or saved
