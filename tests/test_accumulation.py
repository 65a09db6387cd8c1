"""The partial gradient of an accumulation window is part of the checkpoint (one process; real launches in
``test_bitwise.py``)."""

from __future__ import annotations

import json

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DataLoaderConfiguration
from safetensors.torch import save_file
from torch.utils.data import DataLoader

from accelerate_stateful import Accelerator, CheckpointError, UnsupportedConfigError
from accelerate_stateful.checkpoint import _files
from accelerate_stateful.training._accumulation import gradient_file, read_gradients

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def start(carry=True, seed=0):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, carry_gradients=carry,
                              dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = DataLoader(torch.randn(12, 3), batch_size=2)
    return accelerator, *accelerator.prepare(model, optimizer, dl)


def micro_steps(accelerator, model, optimizer, dl, count):
    it = iter(dl)
    for _ in range(count):
        with accelerator.accumulate(model):
            accelerator.backward(model(next(it)).square().mean())
            optimizer.step()
            optimizer.zero_grad()


def grads(model):
    return {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("count", [1, 3, 5], ids=lambda c: f"{c}-micro-steps")
def test_a_save_inside_a_window_carries_every_grad_and_a_load_puts_back_exactly_those(tmp_path, count):
    accelerator, model, optimizer, dl = start()
    micro_steps(accelerator, model, optimizer, dl, count)
    saved = grads(model)
    assert all(g is not None for g in saved.values())
    accelerator.save_state(tmp_path / "ckpt")
    manifest = json.loads((tmp_path / "ckpt" / _files.SUBDIR / _files.MANIFEST).read_text())
    assert f"{_files.SUBDIR}/gradients.rank_0.safetensors" in manifest["files"]

    accelerator, model, optimizer, dl = start(seed=1)
    accelerator.load_state(tmp_path / "ckpt")
    restored = grads(model)
    assert restored.keys() == saved.keys() and all(torch.equal(saved[k], restored[k]) for k in saved)
    assert accelerator.step == count  # Accelerate restores its micro-step counter itself


def test_a_save_at_a_window_boundary_writes_no_gradient_and_a_load_clears_pending_ones(tmp_path):
    accelerator, model, optimizer, dl = start()
    micro_steps(accelerator, model, optimizer, dl, 2)
    accelerator.save_state(tmp_path / "ckpt")
    assert not gradient_file(tmp_path / "ckpt", 0).exists()
    micro_steps(accelerator, model, optimizer, dl, 1)  # a window under way in this process
    accelerator.load_state(tmp_path / "ckpt")
    assert all(g is None for g in grads(model).values())


def test_carry_gradients_false_writes_none(tmp_path):
    accelerator, model, optimizer, dl = start(carry=False)
    micro_steps(accelerator, model, optimizer, dl, 1)
    accelerator.save_state(tmp_path / "ckpt")
    assert not gradient_file(tmp_path / "ckpt", 0).exists()


def test_a_checkpoint_missing_its_gradient_file_is_incomplete_and_changes_nothing(tmp_path):
    accelerator, model, optimizer, dl = start()
    micro_steps(accelerator, model, optimizer, dl, 1)
    accelerator.save_state(tmp_path / "ckpt")
    gradient_file(tmp_path / "ckpt", 0).unlink()
    accelerator, model, optimizer, dl = start(seed=1)
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointError, match=r"gradients.rank_0.safetensors is listed in its manifest but missing"):
        accelerator.load_state(tmp_path / "ckpt")
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))


def test_a_gradient_for_another_model_is_refused_with_the_fix(tmp_path):
    accelerator, model, optimizer, dl = start()
    micro_steps(accelerator, model, optimizer, dl, 1)
    accelerator.save_state(tmp_path / "ckpt")
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    other = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    model, _, _ = other.prepare(torch.nn.Linear(3, 2), torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1),
                                DataLoader(torch.randn(12, 3), batch_size=2))
    with pytest.raises(CheckpointError, match=r"holds a gradient for model_0/0.bias of shape \(4,\), but this run's "
                                              r"model has no such parameter; prepare the same models"):
        other.load_state(tmp_path / "ckpt")


def test_a_gradient_that_cannot_be_carried_is_refused_at_the_entry_before_anything_is_written(tmp_path):
    accelerator, model, optimizer, dl = start()
    micro_steps(accelerator, model, optimizer, dl, 1)
    model[0].weight.grad = torch.zeros(4, 3).to_sparse()
    with pytest.raises(UnsupportedConfigError, match=r"cannot carry the partial gradient of model_0/0.weight.*"
                                                     r"sync_gradients is True.*carry_gradients=False"):
        accelerator.save_state(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("saved_world,world", [(2, 3), (3, 1), (2, 1)])
def test_an_elastic_resume_gives_every_rank_the_mean_of_the_saved_partial_sums(tmp_path, saved_world, world):
    """The window's gradient, averaged over ranks when it completes, keeps what was accumulated before the save."""
    model = torch.nn.Linear(2, 1)
    (tmp_path / _files.SUBDIR).mkdir()
    files = {}
    for rank in range(saved_world):
        save_file({"model_0/weight": torch.full((1, 2), float(rank + 1)), "model_0/bias": torch.full((1,), 2.0 * rank)},
                  gradient_file(tmp_path, rank))
        files[gradient_file(tmp_path, rank).relative_to(tmp_path).as_posix()] = {}
    manifest = {"world_size": saved_world, "files": files}
    for rank in range(world):
        got = read_gradients(tmp_path, manifest, rank, world, [model])
        assert torch.equal(got["model_0/weight"], torch.full((1, 2), (saved_world + 1) / 2))
        assert torch.equal(got["model_0/bias"], torch.full((1,), float(saved_world - 1)))
    del files[gradient_file(tmp_path, 0).relative_to(tmp_path).as_posix()]
    with pytest.raises(CheckpointError, match=r"partial gradients for ranks \[1.*not in the same place"):
        read_gradients(tmp_path, manifest, 0, world, [model])


def test_the_carry_is_sized_when_written_and_by_inspect(tmp_path, caplog):
    from cli_run import cli_json, run_cli

    accelerator, model, optimizer, dl = start()
    micro_steps(accelerator, model, optimizer, dl, 1)
    with caplog.at_level("WARNING", logger="accelerate_stateful.accelerator"):
        accelerator.save_state(tmp_path / "inside")
    tensor_bytes = 4 * sum(p.numel() for p in model.parameters())  # float32 .grad of every parameter
    assert f"partial gradient of the accumulation window in {tmp_path / 'inside'}: {tensor_bytes} B" in caplog.text
    carry = cli_json("inspect", tmp_path / "inside")["gradient_carry"]
    assert carry == {"bytes": tensor_bytes, "ranks": [{"rank": 0, "bytes": tensor_bytes, "kinds": ["grad"]}]}
    text = run_cli("inspect", tmp_path / "inside")[1]
    assert f"gradients   {tensor_bytes} B carried from inside an accumulation window" in text

    micro_steps(accelerator, model, optimizer, dl, 1)  # the window ends: nothing to carry
    caplog.clear()
    accelerator.save_state(tmp_path / "boundary")
    assert "partial gradient" not in caplog.text
    assert cli_json("inspect", tmp_path / "boundary")["gradient_carry"] is None
    assert "gradients   none carried" in run_cli("inspect", tmp_path / "boundary")[1]
