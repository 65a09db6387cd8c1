"""Loading checks the format version, the topology and the settings, and says what to do."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from accelerate_stateful import (
    DistContext,
    ShardDataLoader,
    StateMismatchError,
    UnsupportedConfigError,
)


def make(n=20, batch_size=4, rank=0, world=2, seed=0, drop_last=False, shuffle=True, **kw):
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    dl = DataLoader(list(range(n)), batch_size=batch_size, shuffle=shuffle, generator=generator, drop_last=drop_last)
    return ShardDataLoader.from_dataloader(dl, DistContext(rank, world), **kw)


def saved(**kw):
    loader = make(**kw)
    it = iter(loader)
    next(it)
    return loader.state_dict()


def test_every_mismatching_setting_is_listed_with_saved_and_current_values_and_the_fix():
    with pytest.raises(StateMismatchError) as info:
        make(n=24, batch_size=8, drop_last=True, seed=1).load_state_dict(saved())
    message = str(info.value)
    for line in (
        "len(dataset): saved 20, current 24",
        "drop_last: saved False, current True",
        "generator seed): saved 0, current 1",
    ):
        assert line in message
    assert "use the same len(dataset), drop_last, " in message and "start a fresh run" in message
    assert info.value.saved["dataset_length"] == 20 and info.value.current["dataset_length"] == 24
    assert "batch_size" not in message  # a map-style position is re-cut at another batch size (test_rebatch.py)


def test_a_changed_shuffle_setting_is_a_mismatch():
    with pytest.raises(StateMismatchError, match=r"shuffle/sampler \(the epoch order\): saved 'random', current 'sequential'"):
        make(shuffle=False).load_state_dict(saved())


def test_a_seed_drawn_at_random_yields_to_the_checkpoints_seed():
    source = make()
    full = [b.tolist() for b in source]
    state = make().state_dict()
    torch.manual_seed(77)
    drawn = make(seed=None)  # shuffle without a generator: the seed is drawn from the global RNG
    assert drawn.seed != 0
    drawn.load_state_dict(state)
    assert drawn.seed == 0 and [b.tolist() for b in drawn] == full


def test_a_newer_format_version_is_refused_with_the_fix():
    state = dict(saved(), format_version=99)
    with pytest.raises(UnsupportedConfigError, match="format_version=99.*upgrade accelerate-stateful"):
        make().load_state_dict(state)


@pytest.mark.parametrize(
    "edit,match",
    [
        pytest.param({"samples_consumed": 5}, "inconsistent position", id="off-boundary"),
        pytest.param({"batches_yielded": 3}, "batches_yielded=3", id="counts-disagree"),
        pytest.param({"samples_consumed": -8}, "negative", id="negative"),
        pytest.param({"epoch": "1"}, "invalid 'epoch'", id="wrong-type"),
        pytest.param({"format_version": None}, "not an accelerate-stateful loader state", id="no-version"),
    ],
)
def test_a_hand_edited_inconsistent_state_is_refused(edit, match):
    with pytest.raises(UnsupportedConfigError, match=match):
        make().load_state_dict(dict(saved(), **edit))


def test_a_state_that_is_not_a_dict_is_refused():
    with pytest.raises(UnsupportedConfigError, match="must be a dict"):
        make().load_state_dict([1, 2])


def test_a_state_that_is_not_on_a_step_boundary_of_its_own_topology_is_refused_on_another_world_size():
    state = dict(saved(), samples_consumed=6)
    with pytest.raises(UnsupportedConfigError, match="inconsistent position"):
        make(world=3).load_state_dict(state)


def test_another_ranks_state_is_refused():
    with pytest.raises(UnsupportedConfigError, match="belongs to rank 1, this is rank 0"):
        make(rank=0).load_state_dict(saved(rank=1))


def test_a_refused_load_changes_nothing():
    loader = make()
    before = loader.state_dict()
    with pytest.raises(StateMismatchError):
        loader.load_state_dict(saved(n=24))
    assert loader.state_dict() == before


@pytest.mark.parametrize(
    "make_loader,match",
    [
        pytest.param(
            lambda: DataLoader(torch.utils.data.TensorDataset(torch.arange(4)), batch_size=None),
            "no batch_size",
            id="no-batch-size",
        ),
        pytest.param(
            lambda: DataLoader(list(range(10)), batch_size=3),
            "batch_size divisible by the number of processes",
            id="split-indivisible",
        ),
    ],
)
def test_an_unsupported_loader_is_refused_at_prepare_with_the_fix(make_loader, match):
    with pytest.raises(UnsupportedConfigError, match=match):
        ShardDataLoader.from_dataloader(make_loader(), DistContext(0, 2), split_batches=True)


def test_an_iterable_dataset_is_refused_until_supported():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(UnsupportedConfigError, match="Stream is an IterableDataset"):
        ShardDataLoader.from_dataloader(DataLoader(Stream(), batch_size=2), DistContext(0, 1))
