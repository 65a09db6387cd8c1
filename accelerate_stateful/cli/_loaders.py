"""Map-style loaders rebuilt from a checkpoint alone, to answer "which samples" without the data.

A saved shard (or dispatcher) state records everything its position means:
batch size, dataset length, order kind, seed, ``drop_last``, ``even_batches``,
``split_batches``, world size and rank. The command-line tool rebuilds the very
loader classes training used, over the dataset ``range(dataset_length)`` (whose
sample ``i`` is the index ``i``), and loads the state into them, so it validates,
restores and lays out batches with the loader's own code and cannot disagree
with a resumed run. Only ``samples`` needs this (and torch), where it cannot answer
from the states alone (``_indices``, ``_dispatched``): a shard loader's epoch too long to draw faster than
torch, a dispatcher's too long to draw as torch does, and an order of a user's own sampler, which it refuses;
``inspect`` and ``verify`` read positions with ``_position``.
"""

from __future__ import annotations

import itertools
from typing import Any, Mapping, Optional

import torch

from ..checkpoint import _state as S
from ._position import with_reader
from .._context import DistContext
from ..position._distributed import order_length
from ..position._order import EpochOrder, SequentialOrder, ShuffledOrder
from ..loaders.dispatch import DispatchDataLoader
from ..errors import CheckpointError
from ..loaders.shard import ShardDataLoader, _PlanBatchSampler
from ._read import NotAnswerable, require_map_style, sampler_refusal

_REPRODUCIBLE = {SequentialOrder.kind: SequentialOrder, ShuffledOrder.kind: ShuffledOrder}


class RecordedOrder(EpochOrder):
    """The epoch order a checkpoint names: drawn again for sequential and shuffled orders, never guessed."""

    def __init__(self, kind: str, num_samples: int, fingerprint: Optional[str] = None) -> None:
        super().__init__(num_samples)
        self.kind = kind
        self.fingerprint = fingerprint

    def known_fingerprint(self, seed: int, epoch: int) -> Optional[str]:
        """The saved fingerprint of an order this tool cannot draw (describing a position needs no order)."""
        return None if self.kind in _REPRODUCIBLE else (self.fingerprint or "not recorded")

    def indices(self, seed: int, epoch: int) -> torch.Tensor:
        if self.kind not in _REPRODUCIBLE:
            raise NotAnswerable(sampler_refusal(self.kind))
        return _REPRODUCIBLE[self.kind](self.num_samples).indices(seed, epoch)


def _shard(config: Mapping[str, Any], state: Mapping[str, Any], ctx: DistContext) -> ShardDataLoader:
    try:
        loader = ShardDataLoader(
            range(config["dataset_length"]),
            order=RecordedOrder(config["order"], config["num_samples"], state.get(S.ORDER_FINGERPRINT)),
            batch_size=config["batch_size"], ctx=ctx, seed=state[S.SEED], seed_source=state[S.SEED_SOURCE],
            drop_last=config["drop_last"], even_batches=config["even_batches"],
            split_batches=config["split_batches"],
        )
        world = state.get(S.ORDER_WORLD)
        if world is not None:  # a DistributedSampler's global order: its length, from the shares it is made of
            length = order_length(loader._plan_at, world, config["num_samples"])
            order = RecordedOrder(config["order"], length, state.get(S.ORDER_FINGERPRINT))
            order.config_length = config["num_samples"]
            loader._base_order = loader._order = order
            loader._plan = loader._plan_from(0)
        return loader
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"the saved loader settings {dict(config)!r} are incomplete or invalid ({exc!r}); the file is damaged "
            "or was edited by hand"
        ) from None


def fresh_loader(state: Mapping[str, Any], ctx: DistContext) -> Any:
    """A loader with the settings ``state`` was saved with, on ``ctx``, at the start of epoch 0."""
    require_map_style(state)
    if state[S.MODE] == ShardDataLoader.mode:
        return _shard(state[S.CONFIG], state, ctx)
    base = state[S.BASE]
    reader = _shard(base[S.CONFIG], base, DistContext(0, 1))
    config = state[S.CONFIG]
    return DispatchDataLoader(reader, ctx, split_batches=config.get("split_batches", False),
                              drop_last=config.get("drop_last", False))


def restored_loader(states: list, rank: int, world_size: int) -> Any:
    """The loader of ``rank`` of ``world_size`` resumed from every saved rank's ``states``, as ``load_state`` does.

    On the saved world size each rank takes its own state; on another, the merged state of all. A checkpoint
    taken right after an epoch's last batch is described as the end of that epoch, every batch taken (a
    resumed loop then starts the next epoch; ``docs/lifecycle.md``).
    """
    ctx = DistContext(rank, world_size)
    own = with_reader(states, rank if len(states) == world_size else 0)
    loader = fresh_loader(own, ctx)
    if len(states) != world_size and loader.needs_all_ranks(own):
        own = loader.merge_rank_states(states)
    loader.load_state_dict(own)
    loader._stand_at_finished_epoch()
    return loader


def resumed_batches(states: list, rank: int, world_size: int, start: int, stop: Optional[int]) -> list[list[int]]:
    """:func:`rank_batches` of the loader :func:`restored_loader` gives, restored afresh for each run of steps it
    reads: a dispatcher's steps before and after those of its size began are two runs."""
    loader = restored_loader(states, rank, world_size)
    began = loader._step_origin[1] if isinstance(loader, DispatchDataLoader) else 0
    if start < began and (stop is None or stop > began):
        return rank_batches(loader, start, began) + resumed_batches(states, rank, world_size, began, stop)
    return rank_batches(loader, start, stop)


def rank_batches(loader: Any, start: int, stop: Optional[int] = None) -> list[list[int]]:
    """This rank's batches ``start`` to ``stop`` (exclusive; ``None``: the epoch's end), as dataset indices.

    A shard loader's batches come from its own batch sampler over its plan (no sample is fetched); a
    dispatcher is run over the index dataset, since its parts are cut from concatenated global batches: from
    where it stands, from a step of the steps of its size (``seek``), or from the epoch's start: before those
    began, after the epoch's last step, or before it read the samples its last step is completed with
    (``_dispatched`` states the same rules without torch).
    """
    if isinstance(loader, ShardDataLoader):
        stop = len(loader) if stop is None else min(stop, len(loader))
        if start >= stop:
            return []
        sampler = _PlanBatchSampler()
        sampler.set_pass(loader._pass_indices(), loader._plan, start, None)
        return list(itertools.islice(iter(sampler), stop - start))
    if loader.batches_yielded != start:
        if start >= loader._step_origin[1] and loader.batches_yielded < len(loader) and loader._first is not None:
            loader.seek(start)
        else:  # a whole run of the epoch at this size, which reads the samples its last step is completed with
            loader._start_epoch(loader.epoch)
    skip = loader.batches_yielded
    batches = iter(loader) if stop is None else itertools.islice(iter(loader), max(stop - skip, 0))
    return [batch.tolist() for batch in batches][start - skip:]
