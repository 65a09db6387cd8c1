"""The lines a user must see: shown by default (warnings), once per run (the main process), naming the package.

Issue 26, "Messages a user never sees, or that mislead": the resume line was logged at INFO (hidden by
default); a mistyped ``project_dir`` and a DataLoader never prepared were silent; the stock resume line named
a scheduler the run did not have and asked for ``set_epoch`` from a script that called it.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import accelerate
import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
from torch.utils.data import DataLoader

import mp_harness
from accelerate_stateful import Accelerator
from accelerate_stateful.training import _training

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "accelerate_stateful"
RANK_SCRIPT = Path(__file__).with_name("mp_messages.py")


def _accelerator(root: Path, cls=Accelerator, stateful: bool = True):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    set_seed(0)
    return cls(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful),
               project_config=ProjectConfiguration(project_dir=str(root), automatic_checkpoint_naming=True))


def _prepared(accelerator, loader: bool = True):
    model = torch.nn.Linear(1, 1)
    parts = [model, torch.optim.SGD(model.parameters(), lr=0.1)]
    return accelerator.prepare(*parts, *([DataLoader(list(range(8)), batch_size=2)] if loader else []))


def _step(accelerator, model, optimizer, batch) -> None:
    accelerator.backward(model(batch.float().unsqueeze(1)).sum())
    optimizer.step()
    optimizer.zero_grad()


def _package_lines(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("accelerate_stateful")]


@pytest.fixture
def no_current_pass(monkeypatch):
    """Passes left current by earlier tests in this process belong to loaders of theirs, not of this test."""
    monkeypatch.setattr(_training, "_current", [])


# --------------------------------------------------------------------------- the resume line
def test_the_resume_line_is_a_warning_naming_the_package_so_it_shows_without_any_logging_set_up(tmp_path, caplog):
    accelerator = _accelerator(tmp_path)
    model, optimizer, dl = _prepared(accelerator)
    for i, batch in enumerate(dl):
        _step(accelerator, model, optimizer, batch)
        if i == 1:
            saved = accelerator.save_state()
            break
    with caplog.at_level(logging.WARNING):
        accelerator.load_state(saved)

    (line,) = [r for r in _package_lines(caplog) if "resuming epoch" in r.getMessage()]
    assert line.levelno == logging.WARNING  # Python shows WARNING and above when nothing is configured
    assert line.getMessage().startswith("[RANK 0] accelerate-stateful: loader 0: resuming epoch 0 at 50.0% on 1 ")


def test_every_module_logs_through_the_logger_that_names_the_package():
    plain = [str(p.relative_to(PACKAGE_ROOT)) for p in sorted(PACKAGE_ROOT.rglob("*.py"))
             if p.name != "_log.py" and re.search(r"logging\.getLogger\(|warnings\.warn\(", p.read_text())]
    assert plain == [], f"modules logging without the package's name: {plain}"


# --------------------------------------------------------------------------- nothing to resume
def test_resume_with_a_mistyped_project_dir_says_it_found_no_checkpoint_there_and_starts_fresh(tmp_path, caplog):
    accelerator = _accelerator(tmp_path / "runs" / "tpyo")
    _prepared(accelerator)
    with caplog.at_level(logging.WARNING):
        assert accelerator.resume() is None

    assert [r.getMessage() for r in _package_lines(caplog)] == [
        f"[RANK 0] accelerate-stateful: no complete checkpoint under {tmp_path / 'runs' / 'tpyo' / 'checkpoints'}, "
        "a folder that does not exist: starting a fresh run; if this run should continue another, check that "
        "ProjectConfiguration(project_dir=...) names the folder that run saved into"
    ]


def test_a_trainer_resuming_true_in_an_output_dir_without_checkpoints_says_so(tmp_path, caplog):
    from transformers import TrainingArguments

    from accelerate_stateful.transformers import StatefulTrainer

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    args = TrainingArguments(str(tmp_path / "out"), report_to=[], use_cpu=True, max_steps=1, save_strategy="no")
    trainer = StatefulTrainer(model=torch.nn.Linear(1, 1), args=args, train_dataset=[torch.zeros(1)] * 4)
    with caplog.at_level(logging.WARNING):
        assert trainer._checkpoint_to_resume(True) is None

    lines = [r.getMessage() for r in _package_lines(caplog)]
    assert lines == [
        f"[RANK 0] accelerate-stateful: no complete checkpoint under {tmp_path / 'out'}: starting a fresh run; if "
        "this run should continue another, check that TrainingArguments(output_dir=...) names the folder that run "
        "saved into"
    ]


# --------------------------------------------------------------------------- a loader never prepared
@pytest.mark.parametrize("prepare_it", [pytest.param(False, id="never-prepared"),
                                        pytest.param(True, id="prepared-but-the-original-iterated")])
def test_training_on_a_loader_that_was_not_prepared_is_said_once_at_the_save(tmp_path, caplog, no_current_pass,
                                                                             prepare_it):
    accelerator = _accelerator(tmp_path)
    model, optimizer = _prepared(accelerator, loader=False)
    plain = DataLoader(list(range(8)), batch_size=2)
    if prepare_it:
        accelerator.prepare(plain)
    with caplog.at_level(logging.WARNING):
        for batch in plain:
            _step(accelerator, model, optimizer, batch)
            saved = accelerator.save_state()

    assert [r.getMessage() for r in _package_lines(caplog)] == [
        "[RANK 0] accelerate-stateful: the model was trained on batches that no loader prepared by "
        "accelerator.prepare() handed out (a DataLoader never passed to prepare(), or the original of one that "
        f"was): {tmp_path / 'checkpoints' / 'checkpoint_0'} does not hold their position, so a resume reads that "
        "data again from its beginning; pass the DataLoader to accelerator.prepare() and iterate the loader it "
        "returns"
    ]
    assert saved.name == "checkpoint_3"


def test_training_on_prepared_loaders_saves_without_a_word(tmp_path, caplog, no_current_pass):
    accelerator = _accelerator(tmp_path)
    model, optimizer, dl = _prepared(accelerator)
    with caplog.at_level(logging.WARNING):
        for epoch in range(2):
            for batch in dl:
                _step(accelerator, model, optimizer, batch)
            accelerator.save_state()
    assert _package_lines(caplog) == []


# --------------------------------------------------------------------------- a stock checkpoint's line
def _stock_checkpoint(root: Path) -> None:
    """Stock Accelerate, no scheduler: 3 of 4 batches of epoch 0, then a save."""
    accelerator = _accelerator(root, accelerate.Accelerator)
    model, optimizer, dl = _prepared(accelerator)
    for i, batch in enumerate(dl):
        _step(accelerator, model, optimizer, batch)
        if i == 2:
            accelerator.save_state()
            return


@pytest.mark.parametrize("set_epoch", [pytest.param(True, id="script-sets-the-epoch"),
                                       pytest.param(False, id="script-does-not")])
def test_the_stock_resume_line_names_what_was_restored_and_asks_for_set_epoch_only_where_missing(
        tmp_path, caplog, set_epoch):
    _stock_checkpoint(tmp_path)
    accelerator = _accelerator(tmp_path)
    model, optimizer, dl = _prepared(accelerator)
    if set_epoch:
        dl.set_epoch(0)
    with caplog.at_level(logging.WARNING):
        accelerator.resume()

    (line,) = [r.getMessage() for r in _package_lines(caplog) if "stock Accelerate" in r.getMessage()]
    assert f"resumed from {tmp_path / 'checkpoints' / 'checkpoint_0'}, a checkpoint of stock Accelerate (left as " \
           "it is): model, optimizer, random states and step (0) through Accelerate's load_state; loader 0: epoch 0 " \
           "at batch 3 of 4" in line
    assert "scheduler" not in line
    assert ("set_epoch" in line) is not set_epoch


# --------------------------------------------------------------------------- 2 processes
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_two_processes_print_one_fresh_start_line_and_one_resume_line_without_any_logging_set_up(tmp_path):
    run = mp_harness.launch([mp_harness.accelerate_command(RANK_SCRIPT, [tmp_path / "run"], 2)], tmp_path / "launch",
                            timeout_s=100)
    assert run.ok, run.report()
    lines = [line for line in run.output.splitlines() if "accelerate-stateful:" in line]
    assert lines == [
        f"[RANK 0] accelerate-stateful: no complete checkpoint under {tmp_path / 'run' / 'checkpoints'}, a folder "
        "that does not exist: starting a fresh run; if this run should continue another, check that "
        "ProjectConfiguration(project_dir=...) names the folder that run saved into",
        f"[RANK 0] accelerate-stateful: loader 0: resuming epoch 0 at 50.0% on 2 ranks x 0 workers "
        f"({tmp_path / 'run' / 'checkpoints' / 'checkpoint_0'})",
    ], run.output
