"""A loader prepared after ``load_state``/``resume()`` takes the position its checkpoint saved for it.

The script layout: prepare the model, optimizer and training loader, resume, then prepare the evaluation
loader. The k-th loader prepared takes the k-th saved state, checked as a load checks it; a save before
it is prepared keeps its saved position. The same with real processes: ``mp_scenarios.py``.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
from torch.utils.data import DataLoader

from accelerate_stateful import Accelerator, CheckpointError, DistContext, ShardDataLoader, StateMismatchError
from accelerate_stateful.checkpoint import _files
PENDING_LOG = "accelerate_stateful.checkpoint._pending"  # the logger that says which saved positions wait

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def start(project: Path) -> Accelerator:
    AcceleratorState._reset_state(True)
    return Accelerator(
        cpu=True,
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
        project_config=ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True),
    )


def loader(n: int, seed: int, batch_size: int = 2) -> DataLoader:
    return DataLoader(list(range(n)), batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed))


def ids(batches) -> list[list[int]]:
    return [batch.tolist() for batch in batches]


def saved_run(project: Path) -> tuple[list, list]:
    """Train 2 batches, evaluate 3 of 5, save: returns the rest of each loader's epoch."""
    accelerator = start(project)
    train, evaluation = accelerator.prepare(loader(12, 0), loader(10, 1))
    it, ev = iter(train), iter(evaluation)
    [next(it) for _ in range(2)], [next(ev) for _ in range(3)]
    accelerator.save_state()
    return ids(it), ids(ev)


def test_a_loader_prepared_after_resume_continues_where_the_checkpoint_saved_it(tmp_path):
    train_rest, eval_rest = saved_run(tmp_path)
    accelerator = start(tmp_path)
    train = accelerator.prepare(loader(12, 0))
    assert accelerator.resume() is not None
    evaluation = accelerator.prepare(loader(10, 1))
    assert accelerator.stateful_loaders == [train, evaluation]
    assert ids(evaluation) == eval_rest
    assert ids(train) == train_rest


def test_two_loaders_prepared_after_load_state_take_the_saved_states_in_preparation_order(tmp_path):
    accelerator = start(tmp_path)
    first, second = accelerator.prepare(loader(8, 2), loader(6, 3, batch_size=3))
    next(iter(first))
    path = accelerator.save_state()
    expected = ids(iter(first)), ids(iter(second))

    accelerator = start(tmp_path)
    accelerator.load_state(path)
    first, second = accelerator.prepare(loader(8, 2), loader(6, 3, batch_size=3))
    assert (ids(first), ids(second)) == expected


def test_a_save_before_the_late_loader_is_prepared_keeps_its_saved_position_and_says_so_once(tmp_path, caplog):
    _, eval_rest = saved_run(tmp_path)
    accelerator = start(tmp_path)
    accelerator.prepare(loader(12, 0))
    accelerator.resume()
    with caplog.at_level(logging.WARNING, logger=PENDING_LOG):
        carried = accelerator.save_state()
        accelerator.save_state()
    assert _files.read_manifest(carried)["num_loaders"] == 2
    said = [r.getMessage() for r in caplog.records if r.name == PENDING_LOG]
    assert len(said) == 1 and "not prepared yet (loader 1: the shard loader of 10 samples with batch_size=2" in said[0]

    accelerator = start(tmp_path)
    accelerator.prepare(loader(12, 0))
    accelerator.load_state(carried)
    assert ids(accelerator.prepare(loader(10, 1))) == eval_rest


def test_a_loader_prepared_after_resume_that_does_not_fit_its_saved_state_is_refused_naming_both(tmp_path):
    saved_run(tmp_path)
    accelerator = start(tmp_path)
    accelerator.prepare(loader(12, 0))
    accelerator.resume()
    with pytest.raises(StateMismatchError, match=(
            r"(?s)prepared as loader 1, after load_state\(\)/resume\(\), does not fit the state .*checkpoint_0 saved for "
            r"loader 1: that state was saved by the shard loader of 10 samples with batch_size=2 and a random order, "
            r"this run prepared the shard loader over list of 14 samples .*len\(dataset\): saved 10, current 14.*"
            r"prepare them in the order of the run that saved it")):
        accelerator.prepare(loader(14, 1))
    assert len(accelerator.stateful_loaders) == 1
    evaluation = accelerator.prepare(loader(10, 1))  # the saved state still waits for the right loader
    assert evaluation.batches_yielded == 3


def saved_on_two_processes(project: Path) -> Path:
    """A checkpoint as a save on 2 processes writes it: Accelerate's files of one process, and the loader states
    of ranks 0 and 1 of 2 (simulated), the evaluation loader 1 batch into its epoch on each."""
    accelerator = start(project)
    accelerator.prepare(loader(12, 0))
    path = accelerator.save_state()
    for index, (n, seed, taken) in enumerate([(12, 0, 0), (10, 1, 1)]):
        for rank in range(2):
            dl = ShardDataLoader.from_dataloader(loader(n, seed), DistContext(rank, 2))
            dl.seek(taken)
            _files.write_loader_state(path, index, rank, dl.state_dict())
    _files.write_manifest(path, world_size=2, num_loaders=2)
    return path


def test_a_loader_prepared_after_a_resume_on_another_number_of_processes_continues_the_saved_epoch(tmp_path):
    path = saved_on_two_processes(tmp_path)
    order = [i for batch in ids(start(tmp_path).prepare(loader(10, 1))) for i in batch]
    accelerator = start(tmp_path)
    accelerator.prepare(loader(12, 0))
    accelerator.load_state(path)
    with pytest.raises(CheckpointError, match=(
            r"cannot keep the saved position of loader 1 \(the shard loader of 10 samples .*\): it was saved in "
            r".*checkpoint_0 on 2 processes and this run "
            r"has not prepared it yet.*prepare it \(accelerator.prepare\(...\)\) before the first save_state\(\)")):
        accelerator.save_state()
    assert _files.numbered_checkpoints(tmp_path / "checkpoints") == [path]  # refused before writing anything
    evaluation = accelerator.prepare(loader(10, 1))
    assert [i for batch in ids(evaluation) for i in batch] == order[4:]  # 2 ranks took 1 batch of 2 each
    assert _files.read_manifest(accelerator.save_state())["num_loaders"] == 2


def test_a_checkpoint_with_fewer_loader_states_than_prepared_is_still_refused(tmp_path):
    accelerator = start(tmp_path)
    accelerator.prepare(loader(12, 0))
    path = accelerator.save_state()
    accelerator = start(tmp_path)
    accelerator.prepare(loader(12, 0), loader(10, 1))
    with pytest.raises(CheckpointError, match="holds 1 loader states, this run prepared 2"):
        accelerator.load_state(path)


def test_the_lifecycle_pages_example_evaluates_the_next_epoch_in_each_run(tmp_path, monkeypatch, capsys):
    page = (Path(__file__).resolve().parent.parent / "docs" / "lifecycle.md").read_text()
    section = page.split("## Loaders prepared after a resume", 1)[1]
    example = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    monkeypatch.chdir(tmp_path)
    for _ in range(3):
        AcceleratorState._reset_state(True)
        exec(compile(example, "docs/lifecycle.md", "exec"), {})
    assert re.findall(r"evaluating epoch \d", capsys.readouterr().out) == [f"evaluating epoch {e}" for e in range(3)]
