"""The four lifecycle states and the behaviour of iter(), state_dict() and load_state_dict() in each."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.utils.data import DataLoader

from accelerate_stateful import DistContext, LifecycleError, Phase, ShardDataLoader


def make(n=10, batch_size=2, rank=0, world=1, **kw):
    dl = DataLoader(list(range(n)), batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(0), **kw)
    return ShardDataLoader.from_dataloader(dl, DistContext(rank, world))


def ids(batches):
    return [b.tolist() for b in batches]


def test_not_started_state_is_complete_and_has_no_side_effects():
    loader = make()
    state = loader.state_dict()
    assert loader.phase is Phase.NOT_STARTED
    assert state["epoch"] == 0 and state["samples_consumed"] == 0 and state["batches_yielded"] == 0
    assert set(state) == set(make().state_dict()) == set(_after_two_batches().state_dict())
    assert loader.state_dict() == state


def _after_two_batches():
    loader = make()
    it = iter(loader)
    next(it), next(it)
    loader._kept = it  # keep the iterator live
    return loader


def test_iterating_state_is_after_the_last_batch_taken():
    loader = _after_two_batches()
    assert loader.phase is Phase.ITERATING
    assert loader.state_dict()["batches_yielded"] == 2
    assert loader.batches_yielded == 2


def test_iter_while_iterating_abandons_the_pass_and_restarts_the_epoch():
    full = ids(make())
    loader = _after_two_batches()
    assert ids(loader) == full
    assert loader.epoch == 1


def test_a_break_without_training_undoes_the_pass_at_the_next_iter_so_it_restarts_the_epoch():
    full = ids(make())
    loader = make()
    for i, _ in enumerate(loader):
        if i == 1:
            break
    # A query is a pure read: the pass let go is still open until the loader's next event (here iter()).
    assert loader.state_dict()["batches_yielded"] == 2 and loader.phase is Phase.ITERATING
    assert ids(loader) == full


def test_load_state_dict_while_an_iterator_is_live_is_refused():
    loader = _after_two_batches()
    with pytest.raises(LifecycleError, match="iterator over this loader is live"):
        loader.load_state_dict(make().state_dict())


def test_load_after_iter_but_before_next_is_refused_so_the_state_is_never_ignored():
    loader = make()
    it = iter(loader)
    with pytest.raises(LifecycleError, match="call it before iter"):
        loader.load_state_dict(_after_two_batches().state_dict())
    assert len(list(it)) == 5


def test_load_after_a_break_is_allowed():
    loader = make()
    for _ in loader:
        break
    loader.load_state_dict(_after_two_batches().state_dict())
    assert loader.phase is Phase.RESTORED and loader.batches_yielded == 2


def test_exhausted_loader_moves_to_the_start_of_the_next_epoch():
    loader = make()
    list(loader)
    assert loader.phase is Phase.EXHAUSTED
    state = loader.state_dict()
    assert (state["epoch"], state["samples_consumed"]) == (1, 0)
    second_epoch = ids(loader)
    fresh = make()
    fresh.set_epoch(1)
    assert ids(fresh) == second_epoch


def test_restored_loader_continues_from_the_restored_position_and_reports_it():
    full = ids(make())
    source = _after_two_batches()
    loader = make()
    loader.load_state_dict(source.state_dict())
    assert loader.phase is Phase.RESTORED
    assert loader.state_dict() == source.state_dict()
    assert ids(loader) == full[2:]


def test_restored_loader_accepts_another_load_which_replaces_the_first():
    loader = make()
    loader.load_state_dict(_after_two_batches().state_dict())
    loader.load_state_dict(make().state_dict())
    assert loader.batches_yielded == 0 and len(ids(loader)) == 5


def test_set_epoch_with_the_current_epoch_keeps_a_restored_position():
    loader = make()
    loader.load_state_dict(_after_two_batches().state_dict())
    loader.set_epoch(0)
    assert loader.batches_yielded == 2


def test_set_epoch_with_another_epoch_moves_to_its_start():
    loader = make()
    loader.load_state_dict(_after_two_batches().state_dict())
    loader.set_epoch(3)
    assert (loader.epoch, loader.batches_yielded, loader.phase) == (3, 0, Phase.NOT_STARTED)


def test_users_who_call_set_epoch_get_the_same_epochs_as_those_who_do_not():
    plain, explicit = make(), make()
    without = [ids(plain) for _ in range(3)]
    with_calls = []
    for epoch in range(3):
        explicit.set_epoch(epoch)
        with_calls.append(ids(explicit))
    assert without == with_calls


def test_set_epoch_while_an_iterator_is_live_is_refused():
    with pytest.raises(LifecycleError, match="set_epoch"):
        _after_two_batches().set_epoch(5)


def test_an_empty_epoch_is_exhausted_at_once():
    loader = make(n=3, batch_size=4, drop_last=True)
    assert len(loader) == 0 and ids(loader) == [] and loader.epoch == 1


def test_end_of_dataloader_is_set_on_the_last_batch_only():
    loader = make(n=9, batch_size=2)
    flags = [loader.end_of_dataloader for _ in loader]
    assert flags == [False, False, False, False, True]


def test_a_prepared_loader_pickles_with_its_position():
    loader = make()
    loader.load_state_dict(_after_two_batches().state_dict())
    copy = pickle.loads(pickle.dumps(loader))
    assert copy.state_dict() == loader.state_dict()
    assert ids(copy) == ids(loader)


def test_a_pickled_loader_mid_iteration_pickles_without_its_iterator():
    loader = _after_two_batches()
    live = loader._kept
    del loader._kept
    copy = pickle.loads(pickle.dumps(loader))
    assert next(live) is not None and loader.batches_yielded == 3  # the original goes on
    assert copy.batches_yielded == 2  # the copy's pass is gone with its iterator: undone at its next event
    assert ids(copy) == ids(make())


def test_unwrap_returns_the_base_loader_and_no_class_is_faked():
    loader = make()
    assert isinstance(loader.unwrap(), DataLoader)
    assert not isinstance(loader, DataLoader)
    assert not hasattr(type(loader), "__getattr__")
    with pytest.raises(AttributeError):
        loader.sampler_that_only_the_base_loader_might_have  # nothing is forwarded blindly
