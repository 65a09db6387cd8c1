"""The Accelerator subclass in one process: prepare, save_state, load_state, resume, GradientState."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from accelerate.data_loader import DataLoaderShard
from accelerate.state import AcceleratorState
from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, ProjectConfiguration
from torch.utils.data import DataLoader

from accelerate_stateful import Accelerator, DispatchDataLoader, IterableShardDataLoader, CheckpointError, ShardDataLoader, SkipDataLoader, StateMismatchError, UnsupportedConfigError
from accelerate_stateful.checkpoint import _files
from accelerate_stateful.checkpoint import _ownership


pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def make_accelerator(out: Path = None, stateful=True, total_limit=None, **kw):
    project = ProjectConfiguration(project_dir=str(out), automatic_checkpoint_naming=True, total_limit=total_limit)
    return Accelerator(
        cpu=True,
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful),
        project_config=project if out is not None else None,
        **kw,
    )


def prepared(accelerator, n=22, batch_size=4):
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = DataLoader(list(range(n)), batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(0))
    return accelerator.prepare(model, optimizer, dl)


def take(dl, count):
    it = iter(dl)
    return [next(it).tolist() for _ in range(count)], it


def test_prepare_returns_the_stateful_shard_loader_and_the_plain_one_when_off(tmp_path):
    _, _, dl = prepared(make_accelerator(tmp_path))
    assert isinstance(dl, ShardDataLoader)
    AcceleratorState._reset_state(True)
    _, _, plain = prepared(make_accelerator(tmp_path, stateful=False))
    assert isinstance(plain, DataLoaderShard)


def test_save_state_writes_each_loader_state_and_a_manifest_and_no_pickled_loader_state(tmp_path):
    accelerator = make_accelerator(tmp_path)
    _, _, dl = prepared(accelerator)
    take(dl, 2)
    path = accelerator.save_state()
    files = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}
    assert {"accelerate_stateful/MANIFEST.json", "accelerate_stateful/loader_0.rank_0.json"} <= files
    assert "model.safetensors" in files
    assert not any(name.startswith("dl_state_dict") for name in files)
    assert _files.read_manifest(path)["num_loaders"] == 1


def test_resume_returns_none_on_a_fresh_start_and_the_newest_complete_checkpoint_after(tmp_path):
    accelerator = make_accelerator(tmp_path)
    model, _, dl = prepared(accelerator)
    assert accelerator.resume() is None
    first, it = take(dl, 3)
    accelerator.save_state()
    rest = [b.tolist() for b in it]
    with torch.no_grad():
        model.weight.fill_(7.0)
    saved = accelerator.save_state()
    AcceleratorState._reset_state(True)

    accelerator = make_accelerator(tmp_path)
    model, _, dl = prepared(accelerator)
    assert accelerator.resume() == saved
    assert model.weight.item() == 7.0
    assert dl.epoch == 1 and dl.batches_yielded == 0
    assert accelerator.project_configuration.iteration == 2
    assert accelerator.save_state().name == "checkpoint_2"
    assert len(first + rest) == len(dl)


def test_resume_continues_mid_epoch_exactly(tmp_path):
    accelerator = make_accelerator(tmp_path)
    _, _, dl = prepared(accelerator)
    full = [b.tolist() for b in dl] + [b.tolist() for b in dl]
    AcceleratorState._reset_state(True)

    accelerator = make_accelerator(tmp_path)
    _, _, dl = prepared(accelerator)
    seen, it = take(dl, 4)
    accelerator.save_state()
    del it
    AcceleratorState._reset_state(True)

    accelerator = make_accelerator(tmp_path)
    _, _, dl = prepared(accelerator)
    accelerator.resume()
    for _ in range(dl.epoch, 2):
        seen += [b.tolist() for b in dl]
    assert seen == full


def test_resume_skips_an_incomplete_newest_checkpoint(tmp_path):
    accelerator = make_accelerator(tmp_path)
    _, _, dl = prepared(accelerator)
    complete = accelerator.save_state()
    take(dl, 1)
    broken = accelerator.save_state()
    (broken / _files.SUBDIR / _files.MANIFEST).unlink()
    assert accelerator.resume() == complete


def test_total_limit_removes_old_checkpoints_only_after_the_new_one_is_complete(tmp_path):
    accelerator = make_accelerator(tmp_path, total_limit=2)
    prepared(accelerator)
    paths = [accelerator.save_state() for _ in range(4)]
    remaining = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert remaining == ["checkpoint_2", "checkpoint_3"]
    assert all(_files.is_complete(p) for p in paths[2:])


def test_a_leftover_of_a_killed_save_with_the_same_number_is_replaced(tmp_path):
    accelerator = make_accelerator(tmp_path)
    prepared(accelerator)
    leftover = tmp_path / "checkpoints" / "checkpoint_0"
    _ownership.write_marker(leftover)  # what a save writes first: the folder is ours
    (leftover / "model.safetensors").write_bytes(b"half")
    assert accelerator.save_state() == leftover
    assert _files.is_complete(leftover)


def test_a_folder_without_our_marker_is_foreign_kept_and_numbered_after(tmp_path):
    accelerator = make_accelerator(tmp_path)
    prepared(accelerator)
    foreign = tmp_path / "checkpoints" / "checkpoint_0"
    foreign.mkdir(parents=True)
    (foreign / "model.safetensors").write_bytes(b"half")
    assert accelerator.save_state() == tmp_path / "checkpoints" / "checkpoint_1"
    assert sorted(p.name for p in foreign.rglob("*")) == ["model.safetensors"]


def test_load_state_refuses_an_incomplete_checkpoint(tmp_path):
    accelerator = make_accelerator(tmp_path)
    prepared(accelerator)
    path = accelerator.save_state()
    (path / _files.SUBDIR / _files.MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        accelerator.load_state(path)


def test_a_mismatching_checkpoint_is_refused_before_the_model_is_touched(tmp_path):
    accelerator = make_accelerator(tmp_path)
    model, _, _ = prepared(accelerator)
    with torch.no_grad():
        model.weight.fill_(3.0)
    path = accelerator.save_state()
    AcceleratorState._reset_state(True)

    accelerator = make_accelerator(tmp_path)
    model, _, _ = prepared(accelerator, n=24)
    with torch.no_grad():
        model.weight.fill_(-1.0)
    with pytest.raises(StateMismatchError, match=r"len\(dataset\): saved 22, current 24"):
        accelerator.load_state(path)
    assert model.weight.item() == -1.0


def test_a_checkpoint_with_another_number_of_loaders_is_refused(tmp_path):
    accelerator = make_accelerator(tmp_path)
    prepared(accelerator)
    path = accelerator.save_state()
    accelerator.prepare(DataLoader(list(range(4)), batch_size=2))
    with pytest.raises(CheckpointError, match="holds 1 loader states, this run prepared 2"):
        accelerator.load_state(path)


def test_gradients_sync_every_k_steps_and_at_the_end_of_the_loader(tmp_path):
    accelerator = make_accelerator(tmp_path, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))
    model, optimizer, dl = prepared(accelerator, n=20, batch_size=4)
    syncs = []
    for batch in dl:
        with accelerator.accumulate(model):
            loss = model(batch.float().unsqueeze(1)).sum()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        syncs.append(accelerator.sync_gradients)
    assert syncs == [False, True, False, True, True]


def test_gather_for_metrics_sees_the_remainder_of_the_last_batch(tmp_path):
    accelerator = make_accelerator(tmp_path)
    _, _, dl = prepared(accelerator, n=10, batch_size=4)
    gathered = [accelerator.gather_for_metrics(batch) for batch in dl]
    assert sorted(torch.cat(gathered).tolist()) == list(range(10))
    assert dl.remainder == 2


def test_skip_first_batches_returns_a_stateful_view_that_saves_its_position(tmp_path):
    accelerator = make_accelerator(tmp_path)
    _, _, dl = prepared(accelerator)
    full = [b.tolist() for b in dl]
    dl.set_epoch(0)
    skipped = accelerator.skip_first_batches(dl, 2)
    assert isinstance(skipped, SkipDataLoader) and len(skipped) == len(dl) - 2
    seen, it = take(skipped, 1)
    path = accelerator.save_state()
    del it
    assert seen == full[2:3]
    AcceleratorState._reset_state(True)

    accelerator = make_accelerator(tmp_path)
    _, _, dl = prepared(accelerator)
    accelerator.load_state(path)
    assert [b.tolist() for b in dl] == full[3:]


def test_resume_without_the_stateful_option_is_refused(tmp_path):
    accelerator = make_accelerator(tmp_path, stateful=False)
    with pytest.raises(UnsupportedConfigError, match="use_stateful_dataloader=True"):
        accelerator.resume()


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(10))


@pytest.mark.parametrize(
    "dispatch,dataset,expected",
    [
        pytest.param(True, list(range(8)), DispatchDataLoader, id="dispatch-map"),
        pytest.param(None, _Stream(), DispatchDataLoader, id="iterable-default-dispatches"),
        pytest.param(False, _Stream(), IterableShardDataLoader, id="iterable-shard"),
        pytest.param(None, list(range(8)), ShardDataLoader, id="map-default-shards"),
    ],
)
def test_prepare_chooses_the_variant_as_accelerate_does(dispatch, dataset, expected):
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True, dispatch_batches=dispatch)
    )
    assert type(accelerator.prepare(DataLoader(dataset, batch_size=2))) is expected


def test_save_state_without_a_directory_and_without_automatic_naming_is_refused():
    accelerator = make_accelerator(None)
    with pytest.raises(ValueError, match="needs an output_dir"):
        accelerator.save_state()


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("even_batches", [False, True])
def test_batches_are_accelerates_own_on_one_process(tmp_path, drop_last, even_batches):
    def batches(stateful):
        accelerator = Accelerator(
            cpu=True,
            dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful, even_batches=even_batches),
        )
        dl = accelerator.prepare(DataLoader(list(range(10)), batch_size=4, drop_last=drop_last))
        out = [[b.tolist() for b in dl] for _ in range(2)]
        AcceleratorState._reset_state(True)
        return out

    assert batches(True) == batches(False)
