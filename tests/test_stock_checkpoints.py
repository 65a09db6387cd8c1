"""Switching a project over: checkpoints of stock Accelerate and Trainer are kept, and resumed from.

Real files written by the real ``accelerate.Accelerator`` and ``transformers.Trainer`` (tiny models built
from a config, nothing downloaded), then the import swapped as the README says.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import accelerate
import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
from torch.utils.data import DataLoader

from accelerate_stateful import Accelerator, CheckpointError, LifecycleError
from accelerate_stateful.checkpoint import _files, _ownership

BATCHES, BATCH = 10, 2  # per epoch, one process


def _reset() -> None:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _parts(cls, root: Path, stateful: bool, shuffle: bool = False, total_limit=None):
    """A fresh accelerator of class ``cls`` with a model, optimizer, scheduler and loader, prepared."""
    _reset()
    set_seed(0)
    accelerator = cls(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful),
                      project_config=ProjectConfiguration(project_dir=str(root), automatic_checkpoint_naming=True,
                                                          total_limit=total_limit))
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9)
    data = torch.arange(BATCHES * BATCH, dtype=torch.float32).unsqueeze(1)
    loader = DataLoader(data, batch_size=BATCH, shuffle=shuffle)
    return accelerator, *accelerator.prepare(model, optimizer, scheduler, loader)


def _train(batch, model, optimizer, scheduler, accelerator) -> list:
    loss = ((model(batch) - batch.sin()) ** 2).mean()
    accelerator.backward(loss)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return batch.flatten().tolist()


def _stock_run(root: Path, stateful: bool, *, shuffle=False, save_at=(), stop_after=None):
    """Stock Accelerate over two epochs; saves after the given steps; returns the batches and final weights."""
    accelerator, model, optimizer, scheduler, loader = _parts(accelerate.Accelerator, root, stateful, shuffle,
                                                              total_limit=2)
    seen, step = [], 0
    for _ in range(2):
        for batch in loader:
            seen.append(_train(batch, model, optimizer, scheduler, accelerator))
            if step in save_at:
                accelerator.save_state()
            if step == stop_after:
                return seen, None
            step += 1
    return seen, model.weight.detach().clone()


def _fingerprint(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _resumed_run(root: Path, *, shuffle=False, epoch=1, skip=0):
    """This package's Accelerator, import swapped: ``resume()``, then to the end of the second epoch."""
    accelerator, model, optimizer, scheduler, loader = _parts(Accelerator, root, True, shuffle, total_limit=2)
    loader.set_epoch(epoch)  # a stock checkpoint records no epoch: the script knows its own
    resumed = accelerator.resume()
    rng_after_resume = torch.get_rng_state()
    seen = []
    for _ in range(loader.epoch, 2):
        batches = accelerator.skip_first_batches(loader, skip) if skip else loader
        skip = 0
        seen += [_train(batch, model, optimizer, scheduler, accelerator) for batch in batches]
    return accelerator, resumed, seen, model.weight.detach().clone(), rng_after_resume


def test_a_stock_run_with_loader_state_is_kept_and_continued_exactly_from_its_newest_checkpoint(tmp_path, caplog):
    reference, final = _stock_run(tmp_path / "reference", True)
    root = tmp_path / "run"
    _stock_run(root, True, save_at=(3, 7, 13), stop_after=15)  # checkpoint_0 rotated away by total_limit=2
    stock = _fingerprint(root / "checkpoints")
    assert sorted({k.split("/")[0] for k in stock}) == ["checkpoint_1", "checkpoint_2"]
    saved_rng = torch.load(root / "checkpoints" / "checkpoint_2" / "random_states_0.pkl", weights_only=False)

    with caplog.at_level(logging.WARNING):
        accelerator, resumed, seen, weights, rng = _resumed_run(root)
    assert resumed == root / "checkpoints" / "checkpoint_2"
    assert seen == reference[14:]  # the rest of the second epoch, exactly as the uninterrupted stock run
    assert torch.equal(weights, final)
    assert torch.equal(rng, saved_rng["torch_manual_seed"])
    line = next(r.getMessage() for r in caplog.records if "stock Accelerate" in r.getMessage())
    assert "checkpoint_2" in line and "epoch 1 at batch 4 of 10 (stock dl_state_dict.bin)" in line
    assert "next save is checkpoint_3" in line

    for number in (3, 4, 5):  # our rotation (total_limit=2) removes only our own checkpoints
        assert accelerator.save_state() == root / "checkpoints" / f"checkpoint_{number}"
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == [
        "checkpoint_1", "checkpoint_2", "checkpoint_4", "checkpoint_5"]
    assert {k: v for k, v in _fingerprint(root / "checkpoints").items() if k in stock} == stock


def test_a_stock_run_without_loader_state_starts_the_epoch_at_its_beginning_and_says_so(tmp_path, caplog):
    reference, final = _stock_run(tmp_path / "reference", False)
    root = tmp_path / "run"
    _stock_run(root, False, save_at=(13,), stop_after=15)
    assert not list(root.rglob("dl_state_dict*.bin"))
    with caplog.at_level(logging.WARNING):
        _, resumed, seen, weights, _ = _resumed_run(root, skip=4)  # the user's stock recipe positions it
    assert resumed == root / "checkpoints" / "checkpoint_0"
    line = next(r.getMessage() for r in caplog.records if "stock Accelerate" in r.getMessage())
    assert "use_stateful_dataloader=False" in line and "epoch 1 starts at its first batch" in line
    assert "accelerator.skip_first_batches(train_dl, n)" in line
    assert seen == reference[14:]
    assert torch.equal(weights, final)


def test_a_shuffled_stock_run_resumes_at_its_position_and_says_the_order_is_this_packages(tmp_path, caplog):
    root = tmp_path / "run"
    _stock_run(root, True, shuffle=True, save_at=(6,), stop_after=6)
    with caplog.at_level(logging.WARNING):
        _, _, seen, _, _ = _resumed_run(root, shuffle=True, epoch=0)
    assert len(seen) == BATCHES - 7 + BATCHES  # the rest of epoch 0 (7 batches taken), then epoch 1
    line = next(r.getMessage() for r in caplog.records if "stock Accelerate" in r.getMessage())
    assert "epoch 0 at batch 7 of 10" in line and "shuffle that its checkpoint does not record" in line


@pytest.mark.parametrize("foreign_numbers", [(0,), (2,), (0, 3), (5,), (1, 2, 7)], ids=str)
@pytest.mark.parametrize("total_limit", [None, 1, 2])
def test_a_foreign_folder_is_never_removed_nor_written_into_and_numbering_continues_after_it(
        tmp_path, foreign_numbers, total_limit):
    accelerator, *_ = _parts(Accelerator, tmp_path, True, total_limit=total_limit)
    root = tmp_path / "checkpoints"
    for number in foreign_numbers:  # a folder named like ours, without our manifest or marker
        (root / f"checkpoint_{number}").mkdir(parents=True)
        (root / f"checkpoint_{number}" / "notes.txt").write_text(f"the user's {number}")
    before = _fingerprint(root)
    written = [accelerator.save_state() for _ in range(3)]
    assert [_files.checkpoint_number(p) for p in written] == [max(foreign_numbers) + 1 + i for i in range(3)]
    assert {k: v for k, v in _fingerprint(root).items() if k in before} == before
    assert all(not (root / f"checkpoint_{n}" / _files.SUBDIR).exists() for n in foreign_numbers)
    kept = [p for p in written if p.exists()]
    assert kept == written[-(total_limit or 3):]
    assert accelerator.resume() == written[-1]  # a foreign folder that is no stock checkpoint is skipped


def test_a_leftover_of_our_killed_save_is_reused_and_a_foreign_one_above_is_kept(tmp_path):
    accelerator, *_ = _parts(Accelerator, tmp_path, True)
    root = tmp_path / "checkpoints"
    _ownership.write_marker(root / "checkpoint_0")  # killed right after its first write
    (root / "checkpoint_0" / "model.safetensors").write_bytes(b"half")
    assert accelerator.save_state() == root / "checkpoint_0" and _files.is_complete(root / "checkpoint_0")
    (root / "checkpoint_1").mkdir()
    (root / "checkpoint_1" / "model.safetensors").write_bytes(b"someone else's")
    assert accelerator.save_state() == root / "checkpoint_2"
    assert (root / "checkpoint_1" / "model.safetensors").read_bytes() == b"someone else's"


def test_an_explicit_save_into_a_foreign_folder_is_refused_before_anything_is_written(tmp_path):
    _reset()
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    accelerator.prepare(torch.nn.Linear(1, 1), DataLoader(torch.zeros(4, 1), batch_size=2))
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "model.safetensors").write_bytes(b"someone else's")
    with pytest.raises(CheckpointError, match="did not write .* never writes into or removes"):
        accelerator.save_state(tmp_path / "theirs")
    assert [p.name for p in (tmp_path / "theirs").iterdir()] == ["model.safetensors"]
    assert _files.is_complete(accelerator.save_state(tmp_path / "empty"))


def test_resume_before_prepare_says_to_call_it_after(tmp_path):
    _reset()
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
                              project_config=ProjectConfiguration(project_dir=str(tmp_path),
                                                                  automatic_checkpoint_naming=True))
    with pytest.raises(LifecycleError, match=r"before accelerator.prepare\(\).*call it after"):
        accelerator.resume()


# --------------------------------------------------------------------------- stock Trainer checkpoints
def _trainer(cls, out: Path, seen: list, stop_at=None, **settings):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == stop_at

    _reset()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1, n_head=1,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    settings = {"max_steps": 10, "save_steps": 3, **settings}
    args = TrainingArguments(str(out), report_to=[], use_cpu=True, per_device_train_batch_size=2, lr_scheduler_type="constant", logging_steps=100, seed=0, **settings)
    data = [{"input_ids": [i, i + 1, i + 2], "labels": [i, i + 1, i + 2]} for i in range(8)]  # 4 batches an epoch
    trainer = cls(model=GPT2LMHeadModel(config), args=args, train_dataset=data,
                  callbacks=[Stop()] if stop_at else [])
    trainer.seen = seen
    return trainer


def _recording(base):
    from torch.utils.data import SequentialSampler

    class Recording(base):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

        def compute_loss(self, model, inputs, *args, **kwargs):
            self.seen.append(inputs["input_ids"].tolist())
            return super().compute_loss(model, inputs, *args, **kwargs)

    return Recording


def _weights(trainer):
    return torch.cat([p.detach().flatten() for p in trainer.model.parameters()])


def test_a_stock_trainer_checkpoint_is_resumed_as_stock_trainer_does_then_statefully(tmp_path, caplog):
    from transformers import Trainer

    from accelerate_stateful.transformers import stateful

    reference = []
    uninterrupted = _trainer(_recording(Trainer), tmp_path / "reference", reference, save_strategy="no")
    uninterrupted.train()
    out = tmp_path / "run"
    _trainer(_recording(Trainer), out, [], stop_at=7, save_total_limit=2).train()  # stock: checkpoint-3, -6
    stock = _fingerprint(out)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-3", "checkpoint-6"]

    seen = []
    resumed = _trainer(stateful(_recording(Trainer)), out, seen, save_total_limit=1)
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=True)
    line = next(r.getMessage() for r in caplog.records if "stock transformers.Trainer" in r.getMessage())
    assert "checkpoint-6" in line and "global_step 6" in line and "epoch 1, 2 batches" in line
    assert resumed.state.global_step == 10
    assert seen == reference[6:]  # steps 7 to 10, as the uninterrupted stock run trained them
    assert torch.equal(_weights(resumed), _weights(uninterrupted))
    # save_total_limit=1 rotated our checkpoint-9 away after checkpoint-10, and kept the stock ones
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-10", "checkpoint-3", "checkpoint-6"]
    assert _files.is_complete(out / "checkpoint-10")
    assert {k: v for k, v in _fingerprint(out).items() if k in stock} == stock


def test_an_explicit_stock_trainer_checkpoint_is_named_for_what_it_is(tmp_path, caplog):
    from transformers import Trainer

    from accelerate_stateful.transformers import stateful

    out = tmp_path / "run"
    _trainer(_recording(Trainer), out, [], stop_at=4).train()
    resumed = _trainer(stateful(_recording(Trainer)), out, [], max_steps=5)
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    line = next(r.getMessage() for r in caplog.records if "stock transformers.Trainer" in r.getMessage())
    assert "global_step 3" in line and "epoch 0, 3 batches" in line and "left as it is" in line
    assert resumed.state.global_step == 5


@pytest.mark.parametrize("debris", [
    pytest.param([], id="our-subfolder-only"),
    pytest.param([".SAVE_STARTED.tmp123"], id="the-marker-half-written"),
])
def test_a_save_killed_while_writing_its_marker_is_ours_reused_and_resume_skips_it_silently(tmp_path, debris, caplog):
    # The marker is the first thing a save writes, but writing it takes a mkdir and a rename: a kill between
    # them leaves only this package's own subfolder, which must not make the folder look like someone else's.
    accelerator, *_ = _parts(Accelerator, tmp_path, True)
    root = tmp_path / "checkpoints"
    first = accelerator.save_state()
    sub = root / "checkpoint_1" / _files.SUBDIR
    sub.mkdir(parents=True)
    for name in debris:
        (sub / name).write_bytes(b"")
    assert not _ownership.is_foreign(root / "checkpoint_1") and _ownership.is_ours(root / "checkpoint_1")
    again, *_ = _parts(Accelerator, tmp_path, True)
    with caplog.at_level("WARNING"):
        assert again.resume() == first
    assert "did not write it" not in caplog.text
    assert again.save_state() == root / "checkpoint_1" and _files.is_complete(root / "checkpoint_1")
