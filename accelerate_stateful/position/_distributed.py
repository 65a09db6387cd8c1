"""A user's ``DistributedSampler`` as one global order that survives a change of world size.

A ``DistributedSampler`` on ``W`` processes gives rank ``r`` the share ``g[r::W]`` of the epoch's global
list ``g`` (the dataset's indices, shuffled from ``seed + epoch`` when ``shuffle``, padded by repeating its
start up to a multiple of ``W``, or cut to one with ``drop_last``). Accelerate then shards the batches of
each rank's share again (``BatchSamplerShard``: rank ``r`` keeps its batches at steps ``r, r + W, ...`` of
its share's stripes), and this package reproduces that exactly. What the ``W`` ranks take, step by step,
is one sequence: at step ``k``, rank 0's batch, then rank 1's, ... This module builds that sequence, the
epoch's *global order at* ``W``; consuming it with the ordinary striping (``ShardPlan``) gives each rank
the batches it had, so the position is the samples all ranks took in that order, like any map-style epoch.

On another number of processes the interrupted epoch keeps the order of the world size that began it
(``order_world_size`` in the state), and the rest of it, from the first sample nobody took, is striped over
the new ranks (the shard loader's elastic rule). The next epochs are the new world size's own, exactly
what a fresh run there reads.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable

import torch
from torch.utils.data import DistributedSampler

from ._order import EpochOrder
from ._plan import ShardPlan
from ._saved import order_length  # noqa: F401  (re-exported: the global order's length)

# plan_for(world_size, rank, num_samples): how the loader stripes an order of num_samples at that topology.
PlanFor = Callable[[int, int, int], ShardPlan]


def owns_sharding(sampler: Any, world_size: int, rank: int) -> bool:
    """Whether ``sampler`` is a ``DistributedSampler`` built for this process (its replicas are the ranks)."""
    return isinstance(sampler, DistributedSampler) and sampler.num_replicas == world_size and sampler.rank == rank


def share_length(sampler: DistributedSampler, world_size: int) -> int:
    """``len()`` of each rank's share on ``world_size`` processes (``DistributedSampler.__init__``'s rule)."""
    n = len(sampler.dataset)
    if sampler.drop_last and n % world_size:
        return math.ceil((n - world_size) / world_size)
    return math.ceil(n / world_size)


def share(sampler: DistributedSampler, world_size: int, rank: int, epoch: int) -> torch.Tensor:
    """The indices ``sampler`` gives ``rank`` of ``world_size`` in ``epoch`` (drawn from a copy of it)."""
    twin = copy.copy(sampler)
    twin.num_replicas, twin.rank = world_size, rank
    twin.num_samples = share_length(sampler, world_size)
    twin.total_size = twin.num_samples * world_size
    twin.set_epoch(epoch)
    return torch.as_tensor(list(iter(twin)), dtype=torch.int64)


class DistributedOrder(EpochOrder):
    """The epoch's global order at ``world_size``: every rank's batches of its share, step by step.

    Args:
        sampler: The user's ``DistributedSampler`` (drawn through copies; it is not changed).
        plan_for: How the loader stripes an order at a topology (the per-rank batch size, ``drop_last``,
            ``even_batches``).
        world_size: The world size whose shares make the order.
    """

    world_dependent = True

    def __init__(self, sampler: DistributedSampler, plan_for: PlanFor, world_size: int) -> None:
        self.sampler, self.plan_for, self.world_size = sampler, plan_for, world_size
        self._twins = {world_size: self}  # shared by every world size's order of this sampler
        length = share_length(sampler, world_size)
        self.plans = [plan_for(world_size, r, length) for r in range(world_size)]
        super().__init__(order_length(plan_for, world_size, length))
        self.kind = f"sampler:{type(sampler).__qualname__}"
        self.config_length = length
        self.padding = self.plans[0].padding  # wrapped entries of the last step, after its real ones

    def at_world(self, world_size: int) -> "DistributedOrder":
        """The same sampler's order at another world size."""
        if world_size not in self._twins:
            twin = DistributedOrder(self.sampler, self.plan_for, world_size)
            twin._twins = self._twins
            self._twins[world_size] = twin
        return self._twins[world_size]

    @staticmethod
    def _take(plan: ShardPlan, step: int, indices: torch.Tensor) -> list[int]:
        return indices[plan.batch_positions(step)].tolist()

    def indices(self, seed: int, epoch: int) -> torch.Tensor:
        shares = [share(self.sampler, self.world_size, r, epoch) for r in range(self.world_size)]
        order: list[int] = []
        for step in range(max((plan.num_batches for plan in self.plans), default=0)):
            for plan, indices in zip(self.plans, shares):
                if step < plan.num_batches:
                    order += self._take(plan, step, indices)
        return torch.as_tensor(order, dtype=torch.int64)
