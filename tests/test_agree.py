"""What defines the data is agreed once, on every rank (issue 25): damaged saved positions are refused at the
load, the save and the elastic merge use one comparison, and the data digest names what differs."""

from __future__ import annotations

import copy
import itertools
import math
import random

import pytest
from torch.utils.data import DataLoader

from accelerate_stateful import IterableShardDataLoader, ShardDataLoader
from accelerate_stateful._context import DistContext
from accelerate_stateful.checkpoint import _compare
from accelerate_stateful.errors import CheckpointError
from accelerate_stateful.loaders._passes import PASS
from accelerate_stateful.sources import Mixture, Packed, Shuffled

DAMAGES = ["x", -1, math.nan, {"foreign": 1}, [["x"]], True]


def mixture() -> Mixture:
    return Mixture({"a": list(range(30)), "b": list(range(100, 130))}, {"a": 1, "b": 2}, seed=1)


def packed() -> Packed:
    return Packed([[1, 2, 3, 4, 5]] * 20, 4)


def shuffled() -> Shuffled:
    return Shuffled(list(range(40)), 8, seed=2)


def packed_mixture() -> Packed:
    return Packed(Mixture({"a": [[1, 2, 3]] * 20, "b": [[7, 8]] * 20}, {"a": 1, "b": 1}), 4)


SOURCES = {"mixture": mixture, "packed": packed, "shuffled": shuffled, "packed-mixture": packed_mixture}


def _leaves(value, path=()):
    """Every path into a saved state, leaves and inner nodes."""
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, path + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _leaves(item, path + (index,))


def _damaged(state, path, damage):
    found = copy.deepcopy(state)
    parent = found
    for key in path[:-1]:
        parent = parent[key]
    if damage == "delete":
        if isinstance(parent, list):
            return None  # a shorter list can be a position too (a shorter carry)
        del parent[path[-1]]
    else:
        parent[path[-1]] = damage
    return found


@pytest.mark.parametrize("make", list(SOURCES.values()), ids=list(SOURCES))
def test_every_damaged_field_of_a_saved_position_is_refused_with_a_checkpoint_error_and_changes_nothing(make):
    source = make()
    list(itertools.islice(iter(source), 7))
    saved = source.state_dict()
    checked = 0
    for path in _leaves(saved):
        if not path or path[-1] == "skip":
            continue
        for damage in DAMAGES + ["delete"]:
            state = _damaged(saved, path, damage)
            if state is None or _still_valid(make, state, path, damage):
                continue
            target = make()
            before = target.state_dict()
            with pytest.raises(CheckpointError):
                target.load_state_dict(state)
            assert target.state_dict() == before, f"a refused load changed the source ({path}, {damage!r})"
            checked += 1
    assert checked > 20


def _still_valid(make, state, path, damage) -> bool:
    """A change that is still a position the source can continue: not damage it could tell."""
    if damage is True and path[-1] in ("ended", "final"):
        return True  # a bool field given another bool
    if path[-1] == "seq_len" and damage == "delete":
        return True  # a position written before Packed recorded its seq_len
    if path[-1] == "seed" and "schedule" not in path and damage == "delete":
        return True  # a position written before Mixture recorded its seed
    if path[-1] == "tokens" and damage == "delete":
        return True  # a position written before Mixture counted tokens
    if "carry" in path and damage == -1:
        return True  # a token id is the user's int, negative ones included
    if "schedule" in path and damage == "delete" and len(path) >= 5:
        return True  # a weights entry without a source: that source was added to the mixture at a later entry
    return False


def test_a_mixture_position_missing_a_source_its_counts_name_is_refused():
    source = mixture()
    list(itertools.islice(iter(source), 7))
    saved = source.state_dict()
    del saved["position"]["sources"]["a"]
    with pytest.raises(CheckpointError, match="Mixture is not one it wrote"):
        mixture().load_state_dict(saved)


@pytest.mark.parametrize("weight", [math.nan, -1.0], ids=["nan", "negative"])
def test_nan_or_negative_saved_weights_are_refused(weight):
    source = mixture()
    list(itertools.islice(iter(source), 7))
    saved = source.state_dict()
    saved["position"]["schedule"][0][1]["a"] = weight
    with pytest.raises(CheckpointError, match="Mixture is not one it wrote"):
        mixture().load_state_dict(saved)


def test_a_packed_position_resumed_with_another_seq_len_is_refused_naming_the_fix():
    source = packed()
    list(itertools.islice(iter(source), 3))
    with pytest.raises(CheckpointError, match=r"seq_len=4.*seq_len=8.*Packed\(seq_len=4\)"):
        Packed([[1, 2, 3, 4, 5]] * 20, 8).load_state_dict(source.state_dict())


@pytest.mark.parametrize("carry", [["a", "b"], {"k": 1}], ids=["strings", "foreign-dict"])
def test_a_packed_carry_of_strings_or_a_foreign_dict_is_a_checkpoint_error(carry):
    source = packed()
    list(itertools.islice(iter(source), 3))
    saved = source.state_dict()
    saved["position"]["carry"] = carry
    with pytest.raises(CheckpointError, match="Packed source is not one it wrote"):
        packed().load_state_dict(saved)


# ----------------------------------------------------------------------------- one comparison, save and merge
def _loader(rank: int, weights=None) -> ShardDataLoader:
    return ShardDataLoader.from_dataloader(DataLoader(list(range(24)), batch_size=2), DistContext(rank, 2),
                                           data_seed=0)


def _states(rng: random.Random) -> list:
    """Two ranks' states, sometimes at different points (a peek, another epoch, another position)."""
    loaders = [_loader(0), _loader(1)]
    common = rng.randrange(0, 5)
    for loader in loaders:
        it = iter(loader)
        for _ in range(common):
            next(it)
        del it
    if rng.random() < 0.5:
        lone = loaders[rng.randrange(2)]
        it = iter(lone)
        for _ in range(rng.randrange(1, 3)):
            next(it)
        del it  # a peek, dropped untrained
        if rng.random() < 0.5:
            lone.set_epoch(lone.epoch + 1)
    return [loader.state_dict() for loader in loaders]


def test_the_save_accepts_exactly_the_rank_states_the_elastic_merge_accepts():
    rng = random.Random(25)
    refused = accepted = 0
    for _ in range(60):
        states = _states(rng)
        save_refuses = _compare.first_difference([_compare.shared_point(s) for s in states]) is not None
        try:
            _loader(0).merge_rank_states(states)
            merge_refuses = False
        except CheckpointError:
            merge_refuses = True
        assert save_refuses == merge_refuses, states
        refused, accepted = refused + save_refuses, accepted + (not save_refuses)
    assert refused and accepted


def test_a_main_process_only_peek_is_named_as_the_cause():
    states = [{"epoch": 0, "samples_consumed": 0, "stripe_origin": None, PASS: None},
              {"epoch": 0, "samples_consumed": 0, "stripe_origin": None,
               PASS: {"origin": {"epoch": 0, "phase": "not_started", "taken": 0, "mark": None}, "trained": False,
                      "peeks": 1}}]
    assert _compare.first_difference([_compare.shared_point(s) for s in states])[1].startswith("the pass in progress")


def test_different_mixture_weights_are_named_with_each_ranks_weights_and_the_fix():
    digests = []
    for rank, weights in enumerate([{"a": 3, "b": 1}, {"a": 1, "b": 2}]):
        mix = mixture()
        mix.set_weights(weights)
        loader = IterableShardDataLoader.from_dataloader(DataLoader(mix, batch_size=2), DistContext(rank, 2),
                                                         data_seed=0)
        digests.append(loader._data_digest())
    refusal = _compare.data_refusal(digests, "accelerator.save_state()", 0)
    assert refusal == (
        "accelerator.save_state() refused for loader 0: the weights of Mixture is not the same on every process "
        "(rank 0: {a: 3, b: 1}, rank 1: {a: 1, b: 2}); call set_weights with the same weights on every process"
    )
