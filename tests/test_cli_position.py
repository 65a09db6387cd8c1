"""``inspect`` and ``verify`` read a map-style position without torch (``cli/_position.py``); these tests hold
what they read against the loaders themselves, resumed from the same states (``cli/_loaders.py``, which
``samples`` uses): the batches in the epoch, the part of it taken, and which states a resume refuses.

Ranks are simulated in this process (``DistContext``). Save points: every batch count of the epoch while the
pass is live, the finished pass (a checkpoint between two epochs), the same without the pass record (as an
earlier release wrote it), and an epoch continued on another number of processes.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch.utils.data import DataLoader

from accelerate_stateful import (
    CheckpointError, DispatchDataLoader, DistContext, ShardDataLoader, StatefulLoaderError,
)
from accelerate_stateful.cli._loaders import restored_loader
from accelerate_stateful.cli._position import map_position
from accelerate_stateful.position._saved import shard_plan


def _configs() -> list:
    found = []
    for world, n, shuffle, drop_last, even, split in itertools.product(
            (1, 2, 3), (7, 23), (False, True), (False, True), (True, False), (False, True)):
        if world == 1 and (split or not even):
            continue
        bs = 6 if split else (1 + n % 4)
        found.append(pytest.param(dict(world=world, n=n, shuffle=shuffle, drop_last=drop_last, even=even,
                                       split=split, bs=bs),
                                  id=f"w{world}-n{n}-{'shuf' if shuffle else 'seq'}-drop{int(drop_last)}"
                                     f"-even{int(even)}-split{int(split)}"))
    return found


def _dataloader(cfg: dict) -> DataLoader:
    generator = torch.Generator().manual_seed(5) if cfg["shuffle"] else None
    return DataLoader(list(range(cfg["n"])), batch_size=cfg["bs"], shuffle=cfg["shuffle"],
                      drop_last=cfg["drop_last"], generator=generator)


def _shard(cfg: dict, rank: int, world: int) -> ShardDataLoader:
    return ShardDataLoader.from_dataloader(_dataloader(cfg), DistContext(rank, world), even_batches=cfg["even"],
                                           split_batches=cfg["split"])


def _dispatcher(cfg: dict, rank: int, world: int) -> DispatchDataLoader:
    return DispatchDataLoader.from_dataloader(_dataloader(cfg), DistContext(rank, world), split_batches=cfg["split"])


def _save_points(cfg: dict, make, world: int, before: list = None):
    """Every rank's states at each save point (``before``: states to resume from first, elastically)."""
    def fresh() -> list:
        loaders = [make(cfg, r, world) for r in range(world)]
        for loader in loaders:
            if before is not None:
                loader.load_state_dict(loader.merge_rank_states(before))
        return loaders

    lengths = [len(loader) for loader in fresh()]
    yield "the epoch's end as an earlier release wrote it", _as_earlier_release([l.state_dict() for l in fresh()])
    for taken in range(min(lengths) + 1):
        loaders = fresh()
        iterators = [iter(loader) for loader in loaders]
        for it in iterators:
            for _ in range(taken):
                next(it)
        states = [loader.state_dict() for loader in loaders]
        yield f"taken {taken}", states
        yield f"taken {taken}, no pass record", [_without_pass_record(s) for s in states]
    loaders = fresh()
    for loader in loaders:
        for _ in loader:
            pass
    states = [loader.state_dict() for loader in loaders]
    yield "finished", states
    yield "finished, no pass record", [_without_pass_record(s) for s in states]


def _as_earlier_release(states: list) -> list:
    """States at their epoch's end, recorded as its last batch taken, without a pass record (before 0.1)."""
    def at_end(state: dict, world: int, rank: int) -> dict:
        plan = shard_plan(state["config"], world, rank, state.get("stripe_origin", 0))
        consumed = plan.samples_consumed(plan.num_steps)
        return dict(_without_pass_record(state), samples_consumed=consumed, batches_yielded=plan.steps_for(consumed))

    world = len(states)
    if states[0]["mode"] == "shard":
        return [at_end(s, world, rank) for rank, s in enumerate(states)]
    reader = at_end(states[0]["base"], 1, 0)
    group = 1 if states[0]["config"]["split_batches"] else world
    read = reader["batches_yielded"]
    steps = read // group if states[0]["config"]["drop_last"] else -(-read // group)
    return [dict(_without_pass_record(s), base=reader if rank == 0 else s["base"], batches_yielded=steps)
            for rank, s in enumerate(states)]


def _without_pass_record(state: dict) -> dict:
    """As an earlier release wrote it: an epoch's end recorded as its last batch taken."""
    return {k: v for k, v in state.items() if k != "pass"}


def _read_by_loader(states: list, rank: int):
    try:
        loader = restored_loader(states, rank, len(states))
    except StatefulLoaderError as exc:
        return type(exc)
    return {"batches_in_epoch": len(loader), "epoch_fraction": loader.progress()}


def _read_without_torch(states: list, rank: int):
    try:
        return map_position(states, rank)
    except StatefulLoaderError as exc:
        return type(exc)


def _agree(states: list, where: str) -> None:
    for rank in range(len(states)):
        assert _read_without_torch(states, rank) == _read_by_loader(states, rank), f"{where}, rank {rank}"


@pytest.mark.parametrize("cfg", _configs())
def test_inspect_reads_the_length_and_progress_a_resumed_shard_loader_reports(cfg):
    world = cfg["world"]
    for where, states in _save_points(cfg, _shard, world):
        _agree(states, where)
    if cfg["split"] and cfg["bs"] % 2:
        return
    saved = list(_save_points(cfg, _shard, 2 if world != 2 else 1))[2][1]  # one step in, on another world size
    for where, states in _save_points(cfg, _shard, world, before=saved):
        _agree(states, f"continued on {world} processes, {where}")


@pytest.mark.parametrize("cfg", [c for c in _configs() if c.values[0]["world"] > 1 and c.values[0]["even"]])
def test_inspect_reads_the_length_and_progress_a_resumed_dispatcher_reports(cfg):
    world = cfg["world"]
    for where, states in _save_points(cfg, _dispatcher, world):
        _agree(states, where)
    if cfg["split"] and cfg["bs"] % 4:
        return
    saved = list(_save_points(cfg, _dispatcher, 4))[2][1]  # one step in, on 4 processes
    for where, states in _save_points(cfg, _dispatcher, world, before=saved):
        _agree(states, f"continued on {world} processes, {where}")


def _damaged(states: list) -> dict:
    """Each kind of damage a resume refuses, applied to a copy of ``states`` (on rank 0, or every rank)."""
    def edit(change, rank: int = 0) -> list:
        copies = copy.deepcopy(states)
        change(copies[rank])
        return copies

    def nested(key, value):
        return lambda s: s["config" if key in s["config"] else "topology"].__setitem__(key, value)

    return {
        "position off a step": edit(lambda s: s.__setitem__("samples_consumed", s["samples_consumed"] + 1)),
        "batches disagree": edit(lambda s: s.__setitem__("batches_yielded", s["batches_yielded"] + 1)),
        "origin past the end": edit(lambda s: s.__setitem__("stripe_origin", 10 ** 6)),
        "negative samples": edit(lambda s: s.__setitem__("samples_consumed", -4)),
        "another rank's file": edit(nested("rank", 1)),
        "no world size": edit(nested("world_size", 0)),
        "batch size 0": edit(nested("batch_size", 0)),
        "no num_samples": edit(lambda s: s["config"].pop("num_samples")),
        "damaged pass record": edit(lambda s: s.__setitem__("pass", {"trained": "yes"})),
        "damaged pass origin": edit(lambda s: s.__setitem__("pass", {"trained": False, "peeks": 0,
                                                                      "origin": {"epoch": "x"}})),
    }


@pytest.mark.parametrize("make", [_shard, _dispatcher], ids=["shard", "dispatcher"])
def test_verify_refuses_exactly_the_states_a_resume_refuses(make):
    cfg = dict(world=2, n=23, shuffle=True, drop_last=False, even=True, split=False, bs=3)
    states = list(_save_points(cfg, make, 2))[4][1]  # two batches in, the pass live
    # A dispatcher's position is its reader's, on the main process: the reader's state is damaged.
    targets = [states[0]["base"]] if make is _dispatcher else states
    for damage, damaged in _damaged(targets).items():
        if make is _dispatcher:
            damaged = [dict(states[0], base=damaged[0]), states[1]]
        for rank in range(2) if make is _dispatcher else [0]:  # a shard rank reads its own state only
            by_loader = _read_by_loader(damaged, rank)
            assert isinstance(by_loader, type), f"the loader accepts '{damage}'; the test no longer damages"
            assert _read_without_torch(damaged, rank) == by_loader, f"{damage}, rank {rank}"


def test_verify_refuses_a_dispatcher_rank_that_disagrees_with_the_main_process():
    cfg = dict(world=2, n=23, shuffle=True, drop_last=False, even=True, split=False, bs=3)
    states = list(_save_points(cfg, _dispatcher, 2))[2][1]
    for damage, change in {"another dataset": lambda s: s["config"].__setitem__("dataset_length", 24),
                           "another chosen seed": lambda s: s.update(seed=s["seed"] + 1, seed_source="data_seed"),
                           "another rank's file": lambda s: s["topology"].__setitem__("rank", 0)}.items():
        damaged = copy.deepcopy(states)
        change(damaged[1])
        by_loader = _read_by_loader(damaged, 1)
        assert isinstance(by_loader, type), f"the loader accepts '{damage}'; the test no longer damages"
        assert _read_without_torch(damaged, 1) == by_loader, damage


@pytest.mark.parametrize("setting, value", [("drop_last", "no"), ("batch_size", 2.5), ("order", None)])
def test_verify_refuses_a_setting_of_the_wrong_type_which_any_resume_refuses_as_a_changed_setting(setting, value):
    """The loader rebuilt from the file alone would take ``drop_last="no"`` as true; a resume compares it with
    the run's own ``False`` and refuses, and so does the command line."""
    cfg = dict(world=2, n=23, shuffle=True, drop_last=False, even=True, split=False, bs=3)
    states = list(_save_points(cfg, _shard, 2))[2][1]
    states[0]["config"][setting] = value
    with pytest.raises(CheckpointError, match="saved loader settings .* are incomplete or invalid"):
        map_position(states, 0)
