"""Issue 26: a stock run's shuffle is continued in its own order, also below a stock folder ahead (moved aside).

Stock ``transformers.Trainer`` (``accelerator_config.use_seedable_sampler=True``, its default) and stock
Accelerate with ``use_seedable_sampler=True`` draw epoch ``e`` as the permutation of a generator seeded with
``seed + e``: this package draws the same, so a stock checkpoint's epoch goes on exactly as stock's would.
"""

from __future__ import annotations

import accelerate
import torch
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader

from accelerate_stateful import Accelerator
from accelerate_stateful.loaders.shard import ShardDataLoader
from accelerate_stateful._context import DistContext
from test_stock_checkpoints import _reset, _trainer, _weights


def _shuffled_recording(base):
    class Recording(base):  # the Trainer's own sampler: RandomSampler, made seedable by Accelerate
        def compute_loss(self, model, inputs, *args, **kwargs):
            self.seen.append(inputs["input_ids"][:, 0].tolist())
            return super().compute_loss(model, inputs, *args, **kwargs)

    return Recording


def test_a_shuffled_stock_trainer_checkpoint_continues_the_stock_order_exactly(tmp_path, caplog):
    from transformers import Trainer

    from accelerate_stateful.transformers import stateful

    reference = []
    uninterrupted = _trainer(_shuffled_recording(Trainer), tmp_path / "reference", reference, save_strategy="no")
    uninterrupted.train()
    out = tmp_path / "run"
    _trainer(_shuffled_recording(Trainer), out, [], stop_at=7).train()  # stock: checkpoint-3, checkpoint-6
    seen = []
    resumed = _trainer(stateful(_shuffled_recording(Trainer)), out, seen)
    with caplog.at_level("WARNING"):
        resumed.train(resume_from_checkpoint=True)
    assert seen == reference[6:]  # the rest of epoch 1 and epoch 2, in the uninterrupted stock run's order
    assert torch.equal(_weights(resumed), _weights(uninterrupted))
    assert "does not record" not in caplog.text


def test_resuming_below_a_newer_stock_checkpoint_moves_it_aside_and_continues_the_stock_order(tmp_path):
    from transformers import Trainer

    from accelerate_stateful.transformers import stateful

    reference = []
    uninterrupted = _trainer(_shuffled_recording(Trainer), tmp_path / "reference", reference, save_strategy="no")
    uninterrupted.train()
    out = tmp_path / "run"
    _trainer(_shuffled_recording(Trainer), out, [], stop_at=7).train()  # stock: checkpoint-3, checkpoint-6
    seen = []
    resumed = _trainer(stateful(_shuffled_recording(Trainer)), out, seen)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    assert seen == reference[3:]  # from step 4 on, in the uninterrupted stock run's order
    assert torch.equal(_weights(resumed), _weights(uninterrupted))
    (aside,) = out.glob("superseded-*")
    assert [p.name for p in aside.iterdir()] == ["checkpoint-6"]


def _epochs(accelerator_class, epochs=3):
    _reset()
    accelerate.utils.set_seed(5)
    accelerator = accelerator_class(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True,
                                                                              use_seedable_sampler=True))
    loader = accelerator.prepare(DataLoader(torch.arange(12), batch_size=3, shuffle=True))
    return [[batch.tolist() for batch in loader] for _ in range(epochs)]


def test_use_seedable_sampler_draws_the_order_stock_accelerate_draws():
    assert _epochs(Accelerator) == _epochs(accelerate.Accelerator)


def test_a_checkpoint_in_the_unseeded_shuffle_order_resumes_in_it_under_use_seedable_sampler():
    ctx = DistContext(rank=0, world_size=1)
    data = DataLoader(torch.arange(12), batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(3))
    before = ShardDataLoader.from_dataloader(data, ctx)  # a checkpoint of an earlier release: "random" order
    iterator = iter(before)
    next(iterator)
    state = before.state_dict()
    expected = [batch.tolist() for batch in iterator]
    after = ShardDataLoader.from_dataloader(data, ctx, use_seedable_sampler=True, data_seed=3)
    after.load_state_dict(state)
    assert [batch.tolist() for batch in after] == expected
    assert after.state_dict()["config"]["order"] == "random"


def test_stock_trainer_resumes_a_checkpoint_of_ours_in_the_same_order_the_way_back(tmp_path):
    from transformers import Trainer

    from accelerate_stateful.transformers import stateful

    reference = []
    _trainer(_shuffled_recording(Trainer), tmp_path / "reference", reference, save_strategy="no").train()
    out = tmp_path / "run"
    ours = []
    _trainer(stateful(_shuffled_recording(Trainer)), out, ours, stop_at=7).train()  # ours: checkpoint-3, -6
    seen = []
    _trainer(_shuffled_recording(Trainer), out, seen).train(resume_from_checkpoint=str(out / "checkpoint-6"))
    # Stock Trainer's data skip lands where our loader stood, in the same order: each epoch's samples once.
    assert ours[:6] + seen == reference
