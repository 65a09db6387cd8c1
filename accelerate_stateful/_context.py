"""The distributed context of a loader, as a value rather than a global; and how long the package may wait.

Every wait of the package's own (ranks entering a checkpoint operation, a DataLoader worker's reply) is
derived from the process group's collective timeout, so that the package's error comes before any
collective of the job gives up: see :func:`package_timeout`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist

from .errors import UnsupportedConfigError


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
        """The context of this process: ``torch.distributed``'s where a process group is initialised (the
        processes that really run together), else Accelerate's.

        Raises:
            UnsupportedConfigError: Accelerate already counts the processes otherwise than the process group
                (e.g. torchrun on CPU without ``ACCELERATE_USE_CPU=1``: every process thinks it runs alone).
        """
        from accelerate.state import PartialState

        if not (dist.is_available() and dist.is_initialized()):
            state = PartialState()
            return cls(rank=state.process_index, world_size=state.num_processes)
        rank, world_size = dist.get_rank(), dist.get_world_size()
        if PartialState._shared_state:  # Accelerate has decided already; never decide for it here
            state = PartialState()
            # The world sizes are the same on every rank, so every rank refuses, or none does.
            if state.num_processes != world_size:
                raise UnsupportedConfigError(
                    f"Accelerate sees this process as rank {state.process_index} of {state.num_processes} "
                    f"({state.distributed_type}), but torch.distributed's process group has it as rank {rank} of "
                    f"{world_size}: data would not be split and every rank would save as rank 0; launch with "
                    "`accelerate launch`, or on CPU under torchrun set ACCELERATE_USE_CPU=1 (or pass "
                    "Accelerator(cpu=True))"
                )
        return cls(rank=rank, world_size=world_size)

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


def collective_timeout() -> Optional[float]:
    """Seconds after which a collective of the default process group gives up; ``None`` without one.

    The backend's own timeout (what ``init_process_group(timeout=...)`` and Accelerate's
    ``InitProcessGroupKwargs(timeout=...)`` set), else the rendezvous store's, which the same argument sets.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = dist.distributed_c10d._get_default_group()
    found = []
    for device in group._device_types:
        timeout = getattr(getattr(group._get_backend(device), "options", None), "_timeout", None)
        if timeout is not None:
            found.append(timeout.total_seconds())
    if not found:
        found.append(dist.distributed_c10d._get_default_store().timeout.total_seconds())
    return min(found)


def package_timeout(env: str, default: float) -> float:
    """How long the package waits for something before it raises: half the collective timeout.

    Half leaves the other half for the error to reach every rank (each wait sits inside a step that
    :func:`~accelerate_stateful.checkpoint._checkpoints.agree` or the entry rendezvous shares) before a
    rank waiting in a collective gives up. Without a process group, ``default``. The environment
    variable ``env`` may set a shorter wait, never one that reaches the collective timeout's half.

    Raises:
        UnsupportedConfigError: ``env`` is not a number of seconds below half the collective timeout.
    """
    limit = collective_timeout()
    bound = default if limit is None else limit / 2
    raw = os.environ.get(env)
    if raw is None:
        return bound
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < math.inf or (limit is not None and value >= bound):
        below = "" if limit is None else (
            f" and below half of the process group's collective timeout ({limit:.0f} s), so that this package's "
            "error comes before a collective gives up; raise that timeout with Accelerate's "
            "InitProcessGroupKwargs(timeout=timedelta(seconds=...)) if you need longer"
        )
        raise UnsupportedConfigError(f"{env}={raw!r}: it must be a number of seconds above 0{below}")
    return value
