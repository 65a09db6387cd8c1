"""The distributed context of a loader, as a value rather than a global."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    """Which rank this loader runs on, out of how many.

    A plain value, so that a test can build the loader of rank 3 of 4 in one
    process: ``DistContext(rank=3, world_size=4)``. Collectives are only used
    when a process group is really initialised with more than one rank.

    Examples:
        >>> DistContext(rank=1, world_size=2).is_main
        False
    """

    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"invalid distributed context: rank={self.rank}, world_size={self.world_size}")

    @classmethod
    def detect(cls) -> "DistContext":
        """The context of this process, as Accelerate sees it."""
        from accelerate.state import PartialState

        state = PartialState()
        return cls(rank=state.process_index, world_size=state.num_processes)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_collective(self) -> bool:
        """Whether collectives reach real peers (else this process stands alone or is simulated)."""
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (``value`` itself without a process group)."""
        if not self.is_collective:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (``[value]`` without a process group)."""
        if not self.is_collective:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return gathered

    def barrier(self) -> None:
        if self.is_collective:
            dist.barrier()
