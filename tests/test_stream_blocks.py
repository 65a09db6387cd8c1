"""A composable source's batches do not depend on ``num_workers``: the same training run on any number of workers.

The outermost source deals its items to the worker shares in blocks of one worker batch (``sources/_global``),
so worker ``w`` makes the sequence's batches ``w, w + n, ...`` and the loader, taking the workers' batches in
turn, hands every rank, step for step, the batches of a run without workers. Checked over drawn configurations
(the source's shape, ranks simulated in one process, batch size, shard mode or dispatcher, ``drop_last``),
uninterrupted and resumed on another number of workers at a drawn step; and a checkpoint written before blocks
were recorded (item by item) still resumes exactly, keeping its split for the rest of its epoch.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.data import DataLoader

from accelerate_stateful import DispatchDataLoader, DistContext, IterableShardDataLoader
from accelerate_stateful.sources import Filtered, Mixture, Packed, Shuffled

from harness import through_files

EPOCHS = 2


def _source(shape: str, seed: int):
    docs = {"a": [[i] * (1 + i % 4) for i in range(60)], "b": [[1000 + i] * (2 + i % 3) for i in range(40)]}
    if shape == "packed":
        return Packed(Mixture(docs, {"a": 2, "b": 1}, seed=seed), seq_len=5)
    items = {"a": list(range(200)), "b": list(range(1000, 1150))}
    mix = Mixture(items, {"a": 1, "b": 2}, seed=seed)
    if shape == "shuffled":
        return Shuffled(mix, 7, seed=seed)
    if shape == "filtered":
        return Filtered(mix, lambda item: item % 3 != 0)
    return mix


def _loaders(cfg: dict, workers: int) -> list:
    build = DispatchDataLoader if cfg["dispatch"] else IterableShardDataLoader
    return [build.from_dataloader(DataLoader(_source(cfg["shape"], cfg["seed"]), batch_size=cfg["batch"],
                                             num_workers=workers, drop_last=cfg["drop_last"]),
                                  DistContext(rank, cfg["world"]))
            for rank in range(cfg["world"])]


def _run(loaders: list, stop=None, taken: int = 0) -> tuple[list, list]:
    """Every rank's ``(epoch, batch as lists)`` over the epochs, and at step ``stop`` (counted over the run) the
    ranks' states, the loop stopping there as a killed run does."""
    seen: list = [[] for _ in loaders]
    for rank, loader in enumerate(loaders):
        for epoch in range(loader.epoch, EPOCHS):
            for batch in loader:
                rows = torch.as_tensor(batch["input_ids"] if isinstance(batch, dict) else batch).tolist()
                seen[rank].append((epoch, rows))
                if stop is not None and taken + len(seen[rank]) == stop:
                    break
            else:
                continue
            break
    states = [through_files(loader.state_dict(), rank) for rank, loader in enumerate(loaders)] if stop else []
    return seen, states


def _configs(count: int = 24) -> list:
    rng = random.Random(2811)
    found = []
    for n in range(count):
        cfg = dict(shape=["mixture", "packed", "shuffled", "filtered"][n % 4], world=1 + rng.randrange(3),
                   batch=1 + rng.randrange(4), dispatch=rng.random() < 0.4, drop_last=rng.random() < 0.6,
                   seed=rng.randrange(100), workers=rng.sample([0, 1, 2, 3], 2), stop=1 + rng.randrange(9))
        found.append(pytest.param(cfg, id=f"{cfg['shape']}-world{cfg['world']}-batch{cfg['batch']}"
                                  f"-{'dispatch' if cfg['dispatch'] else 'shard'}"
                                  f"{'-drop_last' if cfg['drop_last'] else ''}-workers{cfg['workers'][0]}"
                                  f"to{cfg['workers'][1]}-at{cfg['stop']}"))
    return found


def _unpadded(cfg: dict, seen: list) -> list:
    """Without ``drop_last`` the epoch's last step is padded by the worker share that holds its last items, with
    that share's first items (a run without workers pads with the epoch's first): that step is left out."""
    if cfg["drop_last"]:
        return seen
    return [[step for n, step in enumerate(rank) if n + 1 < len(rank) and rank[n + 1][0] == step[0]]
            for rank in seen]


@pytest.mark.parametrize("cfg", _configs())
def test_every_rank_gets_the_batches_of_a_run_without_workers_uninterrupted_and_resumed_on_other_workers(cfg):
    reference, _ = _run(_loaders(cfg, 0))
    first, second = cfg["workers"]
    assert _unpadded(cfg, _run(_loaders(cfg, max(first, second)))[0]) == _unpadded(cfg, reference), "on workers"
    before, states = _run(_loaders(cfg, first), stop=cfg["stop"])
    resumed = _loaders(cfg, second)
    for loader, state in zip(resumed, states):
        loader.load_state_dict(state)
    after, _ = _run(resumed, taken=len(before[0]))
    assert _unpadded(cfg, [b + a for b, a in zip(before, after)]) == _unpadded(cfg, reference)


@pytest.mark.parametrize("workers", [(2, 2), (2, 3), (3, 0)], ids=lambda w: f"workers{w[0]}to{w[1]}")
@pytest.mark.parametrize("stop", [1, 3])
def test_a_checkpoint_of_an_item_by_item_split_keeps_it_for_the_rest_of_its_epoch(monkeypatch, workers, stop):
    """Saved by a release that dealt items one by one (a block of 1 records nothing, as that release wrote), the
    rest of the epoch is read item by item: every sample of it exactly once, those of that release's run; the
    next epoch is read in blocks, the batches of a run without workers."""
    cfg = dict(shape="mixture", world=2, batch=3, dispatch=False, drop_last=True, seed=4, workers=workers)
    reference, _ = _run(_loaders(cfg, 0))
    with monkeypatch.context() as patch:
        patch.setattr(IterableShardDataLoader, "_block", lambda self: 1)
        before, states = _run(_loaders(cfg, workers[0]), stop=stop)
        old_run, _ = _run(_loaders(cfg, workers[0]))
    assert all("block" not in str(state) for state in states)
    resumed = _loaders(cfg, workers[1])
    for loader, state in zip(resumed, states):
        loader.load_state_dict(state)
    after, _ = _run(resumed, taken=stop)
    run = [b + a for b, a in zip(before, after)]

    def items(seen: list, epoch: int) -> list:
        return sorted(i for rank in seen for e, rows in rank if e == epoch for i in rows)

    assert items(run, 0) == items(old_run, 0) and len(items(run, 0)) == len(set(items(run, 0)))
    assert [[step for step in rank if step[0] == 1] for rank in run] == [
        [step for step in rank if step[0] == 1] for rank in reference]


def _global_steps(seen: list) -> list:
    """Per step, the rows of every rank together (sorted): what a step trained on, whichever rank had which row."""
    return [sorted(row for rank in seen for row in (rank[n][1] if n < len(rank) else [])) for n in
            range(max(len(rank) for rank in seen))]


def _regroup_configs(count: int = 16) -> list:
    rng = random.Random(1129)
    found = []
    for n in range(count):
        worlds = rng.choice([(1, 2), (2, 3), (3, 2), (2, 1), (3, 1), (1, 3), (2, 2)])
        cfg = dict(shape=["mixture", "packed", "shuffled", "filtered"][n % 4], dispatch=rng.random() < 0.5,
                   seed=rng.randrange(100), workers=(rng.choice([0, 1, 2, 3]), rng.choice([0, 1, 2, 3])),
                   worlds=worlds, stop=1 + rng.randrange(5))
        found.append(pytest.param(cfg, id=f"{cfg['shape']}-{'dispatch' if cfg['dispatch'] else 'shard'}-world"
                                  f"{worlds[0]}to{worlds[1]}-workers{cfg['workers'][0]}to{cfg['workers'][1]}"
                                  f"-at{cfg['stop']}"))
    return found


@pytest.mark.parametrize("cfg", _regroup_configs())
def test_a_run_resumed_on_other_processes_and_workers_trains_each_step_on_the_uninterrupted_runs_rows(cfg):
    """The global batch kept (6 rows a step on 1, 2 or 3 ranks), a run saved at a drawn step and resumed on
    another number of processes and workers trains every step on the rows the uninterrupted run trained on then:
    the rest of the epoch is dealt again from the first item no share handed out (``loaders/_frontier``)."""
    def at(world: int) -> dict:
        return dict(cfg, world=world, batch=6 // world, drop_last=True)

    first, second = cfg["worlds"]
    reference = _global_steps(_run(_loaders(at(first), 0))[0])
    before, states = _run(_loaders(at(first), cfg["workers"][0]), stop=cfg["stop"])
    resumed = _loaders(at(second), cfg["workers"][1])
    for rank, loader in enumerate(resumed):
        loader.load_state_dict(states[rank] if first == second else states[0])
    after, _ = _run(resumed, taken=cfg["stop"])
    steps = _global_steps(before)[: cfg["stop"]] + _global_steps(after)
    assert steps[: len(reference)] == reference[: len(steps)]
