"""Every refusal names what the user changed, in the user's terms, and the fix; and it changes nothing."""

from __future__ import annotations

import itertools

import pytest
import torch
from accelerate.state import AcceleratorState
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader, Sampler

from accelerate_stateful import (
    Accelerator,
    CheckpointError,
    DistContext,
    ShardDataLoader,
    StateMismatchError,
    UnsupportedConfigError,
)
from accelerate_stateful.checkpoint._refusals import SETTINGS

INTERNAL = ("samples_consumed", "stripe_origin", "batches_yielded", "sliced_per_rank", "num_samples",
            "dataset_length", "'config'", "topology")


def loaders_of(sizes):
    return [DataLoader(list(range(n)), batch_size=b, shuffle=s, generator=torch.Generator().manual_seed(1))
            for n, b, s in sizes]


def accelerator_with(sizes):
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    return accelerator, accelerator.prepare(*loaders_of(sizes))


SIZES = [(20, 4, True), (33, 5, False), (12, 3, True)]


@pytest.mark.parametrize("order", [p for p in itertools.permutations(range(3)) if p != (0, 1, 2)])
def test_loaders_prepared_in_another_order_are_named_with_the_fix(tmp_path, order):
    accelerator, loaders = accelerator_with(SIZES)
    it = iter(loaders[1])
    next(it)
    accelerator.save_state(tmp_path / "ckpt")
    accelerator, loaders = accelerator_with([SIZES[i] for i in order])
    before = [loader.state_dict() for loader in loaders]
    with pytest.raises(CheckpointError, match=r"prepared in another order.*loader 0 was the shard loader over list of "
                                              r"20 samples with batch_size=4.*same order") as info:
        accelerator.load_state(tmp_path / "ckpt")
    assert f"(prepared as loader {order.index(0)} now)" in str(info.value)
    assert [loader.state_dict() for loader in loaders] == before


def test_a_changed_setting_in_the_same_order_is_still_listed_setting_by_setting(tmp_path):
    accelerator, _ = accelerator_with(SIZES)
    accelerator.save_state(tmp_path / "ckpt")
    accelerator, _ = accelerator_with([SIZES[0], (34, 5, False), SIZES[2]])
    with pytest.raises(StateMismatchError, match=r"len\(dataset\): saved 33, current 34\n.*\nuse the same "
                                                 r"len\(dataset\), samples per epoch"):
        accelerator.load_state(tmp_path / "ckpt")


class PerProcess(Sampler):
    """A sampler of one process's share that is not a DistributedSampler: its order cannot be re-dealt."""

    def __init__(self, n: int, world: int, rank: int) -> None:
        self.indices = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def _per_process(world: int, rank: int, n: int = 40) -> ShardDataLoader:
    return ShardDataLoader.from_dataloader(DataLoader(list(range(n)), batch_size=2, sampler=PerProcess(n, world, rank)),
                                           DistContext(rank, world))


@pytest.mark.parametrize("saved,now", [(2, 3), (3, 2), (2, 1), (1, 2)])
def test_a_sampler_whose_length_follows_the_world_size_resumed_on_another_says_what_to_do(saved, now):
    source = _per_process(saved, 0)
    it = iter(source)
    next(it)
    state = source.state_dict()
    target = _per_process(now, 0)
    before = target.state_dict()
    with pytest.raises(UnsupportedConfigError, match=(
            rf"sampler is a PerProcess whose length depends on the number of processes: it drew "
            rf"{-(-40 // saved)} samples per epoch on each of {saved} processes .* draws {-(-40 // now)} on each of "
            rf"{now} now\. Let Accelerate shard the data \(drop the PerProcess.*or resume on {saved} "
            rf"processes")):
        target.load_state_dict(state)
    assert target.state_dict() == before


def test_every_setting_a_mismatch_can_name_has_a_user_term():
    loader = ShardDataLoader.from_dataloader(loaders_of([SIZES[0]])[0], DistContext())
    for field in loader._config():
        label = SETTINGS.get(field, field)
        assert label == field or not any(word in label for word in INTERNAL), field
    assert {"dataset_length", "num_samples", "order"} <= set(SETTINGS)


def test_a_refused_mismatch_never_names_an_internal_field_alone():
    saved = ShardDataLoader.from_dataloader(loaders_of([(20, 4, True)])[0], DistContext()).state_dict()
    target = ShardDataLoader.from_dataloader(loaders_of([(24, 4, False)])[0], DistContext())
    with pytest.raises(StateMismatchError) as info:
        target.load_state_dict(saved)
    message = str(info.value)
    assert "len(dataset): saved 20, current 24" in message and "shuffle/sampler" in message
    assert not any(word in message for word in INTERNAL), message


def test_ranks_saved_out_of_step_are_refused_on_another_world_size_in_words():
    states = []
    for rank, steps in ((0, 1), (1, 2)):
        loader = ShardDataLoader.from_dataloader(loaders_of([SIZES[0]])[0], DistContext(rank, 2))
        it = iter(loader)
        for _ in range(steps):
            next(it)
        states.append(loader.state_dict())
    target = ShardDataLoader.from_dataloader(loaders_of([SIZES[0]])[0], DistContext(0, 3))
    with pytest.raises(CheckpointError, match=r"different points of the data when it was saved \(the samples taken in "
                                              r"the epoch differs: rank 0 at epoch 0, 8 samples taken by all "
                                              r"processes; rank 1 at epoch 0, 16 samples.*same number"):
        target.merge_rank_states(states)
