"""Queries read; events decide (issue 25, item 1): no query of a loader changes what any process decides.

A log line, a shape check or a progress bar that runs on the main process only reads ``dl.epoch``,
``dl.batches_yielded``, ``dl.phase``, ``repr(dl)``, ``dl.state_dict()``... If a query could take a verdict,
register or unregister a pass, or move a counter, the main process would then decide differently from the
others, seal that into a checkpoint, or sync gradients at another step. These tests take every loader
variant to every point of its lifecycle (not started, a pass open, a pass let go but not yet judged,
exhausted, restored mid-epoch, restored between two epochs, an epoch's last batch taken) and check that
every query leaves the loader, its pass records and Accelerate's ``GradientState`` exactly as they were,
and that a program that queries a let-go pass trains on the same batches as one that does not. (The one
documented exception, ``dl.epoch`` right after a resume between two epochs, is ``docs/lifecycle.md``'s.)
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping

import pytest
import torch
from accelerate.state import GradientState
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from accelerate_stateful import DistContext
from accelerate_stateful.loaders.batchsampler import BatchSamplerDataLoader
from accelerate_stateful.loaders.iterable import IterableShardDataLoader
from accelerate_stateful.loaders.shard import ShardDataLoader
from accelerate_stateful.training import _training


class Numbers(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def shard():
    dl = DataLoader(list(range(10)), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0))
    return ShardDataLoader.from_dataloader(dl, DistContext(0, 1))


def batches():
    sampler = BatchSampler(RandomSampler(range(10), generator=torch.Generator().manual_seed(1)), 3, False)
    return BatchSamplerDataLoader.from_dataloader(DataLoader(list(range(10)), batch_sampler=sampler), DistContext(0, 1))


def stream():
    return IterableShardDataLoader.from_dataloader(DataLoader(Numbers(9), batch_size=2), DistContext(0, 1))


VARIANTS = [pytest.param(shard, id="shard"), pytest.param(batches, id="batch-sampler"),
            pytest.param(stream, id="stream")]


def ask_everything(dl) -> None:
    """Every query a program may make, on one process only."""
    _ = (dl.epoch, dl.batches_yielded, dl.phase, repr(dl), dl.state_dict(), dl.progress(), dl.end_of_dataloader,
         dl.skipped_samples, dl.seed, dl.num_workers, dl.dataset)
    try:
        len(dl)
    except TypeError:  # a stream without a length
        pass


def plain(value):
    """A value as plain data, compared by content: tensors and generators by their numbers, records by their
    fields, anything else by identity."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.tolist())
    if isinstance(value, torch.Generator):
        return ("generator", value.get_state().tolist())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__, plain(vars(value)))
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str, enum.Enum)):
        return value
    return ("object", type(value).__name__, id(value))


def snapshot(dl) -> tuple:
    """What a query must not change: the loader's own fields, its lifecycle, its live pass, GradientState."""
    life = dl._life
    live = life.live
    record = None if live is None else {name: plain(getattr(live, name)) for name in live.__slots__}
    fields = {k: v for k, v in vars(life).items() if k not in ("_loader", "_handle", "live")}
    loader = {k: v for k, v in vars(dl).items()  # a memo of a pure function (``_cache*``) may fill on a read
              if k not in ("_life", "_base", "_base_iter") and not k.startswith("_cache")}
    return (plain(fields), record, plain(loader), plain(GradientState().dataloader_references),
            plain(_training._current))


def points(make):
    """``(name, loader, kept)`` at every point of the lifecycle; ``kept`` keeps an iterator alive."""
    yield "not started", make(), None
    dl = make()
    it = iter(dl)
    next(it)
    yield "a pass open", dl, it
    dl = make()
    for _ in dl:
        break
    yield "a pass let go, not yet judged", dl, None
    dl = make()
    list(dl)
    yield "exhausted", dl, None
    saved_mid = _state_after(make, 1)
    dl = make()
    dl.load_state_dict(saved_mid)
    yield "restored mid-epoch", dl, None
    dl = make()
    it = iter(dl)
    taken = [next(it) for _ in range(len(dl))] if _sized(dl) else list(it)
    yield "the epoch's last batch taken", dl, (it, taken)


def _sized(dl) -> bool:
    try:
        len(dl)
        return True
    except TypeError:
        return False


def _state_after(make, n: int) -> dict:
    dl = make()
    it = iter(dl)
    for _ in range(n):
        next(it)
    return dl.state_dict()


@pytest.mark.parametrize("make", VARIANTS)
def test_every_query_leaves_every_lifecycle_point_exactly_as_it_was(make):
    for name, dl, kept in points(make):
        GradientState().dataloader_references = [None]
        before = snapshot(dl)
        ask_everything(dl)
        assert snapshot(dl) == before, f"a query changed the loader at: {name}"
        del kept


@pytest.mark.parametrize("make", VARIANTS)
def test_a_query_of_a_let_go_pass_does_not_change_its_verdict(make):
    """A pass let go, then a training event, then the next pass: the same with or without a query between."""

    def run(query: bool) -> list:
        dl = make()
        model = torch.nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        seen = []
        for batch in dl:
            seen.append(batch.tolist())
            break
        if query:
            ask_everything(dl)  # a log line on the main process only
        model(torch.ones(1, 1)).sum().backward()
        optimizer.step()  # a training event: the pass let go was current, so it was trained on
        seen += [b.tolist() for b in dl]
        return seen + [dl.epoch]

    assert run(query=True) == run(query=False)


def test_a_closed_evaluation_leaves_gradient_state_at_once():
    """``it.close()`` is an event: the pass ends there, and Accelerate's active loader is the training one."""
    train, evaluation = shard(), batches()
    GradientState().dataloader_references = [None]
    outer = iter(train)
    next(outer)
    inner = iter(evaluation)
    next(inner)
    assert GradientState().active_dataloader is evaluation
    inner.close()
    assert GradientState().active_dataloader is train
    assert evaluation._life.live is None
    del outer
