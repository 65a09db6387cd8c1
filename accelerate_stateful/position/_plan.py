"""Pure arithmetic: where each rank's batches lie in an epoch's order.

An epoch is an ordered list of ``num_samples`` *positions* (``0 .. n-1``); which
dataset index sits at each position is the order's business (see ``_order``).
The global progress through an epoch is one number, ``samples_consumed``: how
many positions every rank together has taken. Each rank's cursor is derived
from it, never stored as the truth, so a position survives a change of world
size.

Accelerate's layouts reduce to one formula. With a per-rank batch size ``b``
and ``T = world_size * b`` samples per global step, rank ``r`` at step ``k``
takes positions ``[origin + k*T + r*b, origin + k*T + (r+1)*b)``. This is
``BatchSamplerShard`` both with ``split_batches`` (one global batch of ``T``
cut into ``world_size`` slices) and without (``world_size`` consecutive batches
of ``b``); the tail differs only by ``drop_last`` and ``even_batches``:

- ``drop_last``: only complete global steps are taken;
- ``even_batches``: the last step is completed by wrapping around to the
  start of the epoch (``position mod n``), so every rank gets a full batch;
- neither: positions past the end are cut off, and ranks whose slice starts
  past the end get no batch at that step.

``origin`` is where the current striping of the epoch started: 0 normally,
the consumed count when an epoch is continued on a different world size.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ShardPlan:
    """How one epoch of ``num_samples`` positions is cut into this rank's batches.

    The counts derived from the fields (``total_batch_size``, ``num_batches``, ``num_steps``) are computed once,
    when the plan is made (the plan is frozen, and a loader asks them at every batch).

    Examples:
        >>> plan = ShardPlan(num_samples=10, batch_size=2, world_size=2, rank=1,
        ...                  drop_last=False, even_batches=True)
        >>> [plan.batch_positions(k) for k in range(plan.num_batches)]
        [[2, 3], [6, 7], [0, 1]]
    """

    num_samples: int
    batch_size: int
    world_size: int
    rank: int
    drop_last: bool
    even_batches: bool
    origin: int = 0
    # Derived, set by ``__post_init__`` (plain attributes rather than ``cached_property``, which writes through the
    # instance's ``__dict__``: CPython then specialises no method call on the plan, at every batch).
    total_batch_size: int = field(init=False, repr=False, compare=False)  # samples all ranks take in one step
    _remaining: int = field(init=False, repr=False, compare=False)
    num_batches: int = field(init=False, repr=False, compare=False)  # this rank's batches in the epoch, from origin
    num_steps: int = field(init=False, repr=False, compare=False)  # global steps: the busiest rank's batch count

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {self.batch_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        if not 0 <= self.origin <= self.num_samples:
            raise ValueError(f"origin {self.origin} is outside the epoch of {self.num_samples} samples")
        # Computed here, not at the first read: a plan is the same object before and after any query of it.
        object.__setattr__(self, "total_batch_size", self.batch_size * self.world_size)
        object.__setattr__(self, "_remaining", self.num_samples - self.origin)
        object.__setattr__(self, "num_batches", self._count_batches())
        object.__setattr__(self, "num_steps", self._count_steps())

    def _slice_start(self, step: int) -> int:
        return self.origin + step * self.total_batch_size + self.rank * self.batch_size

    def _count_batches(self) -> int:
        """How many batches this rank yields in the epoch (from ``origin``)."""
        remaining = self._remaining
        if self.drop_last:
            return remaining // self.total_batch_size
        if self.even_batches:
            return _ceil_div(remaining, self.total_batch_size)
        own_start = self.rank * self.batch_size
        return _ceil_div(remaining - own_start, self.total_batch_size) if remaining > own_start else 0

    def _count_steps(self) -> int:
        """How many global steps the epoch has: the batch count of the busiest rank."""
        if self.drop_last:
            return self._remaining // self.total_batch_size
        return _ceil_div(self._remaining, self.total_batch_size)

    def batch_span(self, step: int) -> tuple[int, int]:
        """``(start, stop)`` of this rank's batch at ``step``, before wrapping.

        ``stop`` exceeds ``num_samples`` only for a last batch completed by
        wrapping around (``even_batches``); position ``p`` then means ``p mod n``.
        """
        if not 0 <= step < self.num_batches:
            raise IndexError(f"step {step} is outside this rank's {self.num_batches} batches")
        start = self._slice_start(step)
        stop = start + self.batch_size
        if stop > self.num_samples and not (self.even_batches and not self.drop_last):
            stop = self.num_samples
        return start, stop

    def strided_run(self, step: int) -> int:
        """How many of this rank's batches from ``step`` on are whole and evenly spaced.

        Each of them is ``batch_size`` positions long, starts ``total_batch_size`` after the one before and ends
        at or before ``num_samples``: a loader can read them all as one strided view of the epoch's order. The
        batches after them (a last batch completed by wrapping, or cut short) are not.
        """
        last = (self.num_samples - self.origin - (self.rank + 1) * self.batch_size) // self.total_batch_size
        return max(0, min(self.num_batches, last + 1) - step)

    def batch_positions(self, step: int) -> list[int]:
        """The epoch positions of this rank's batch at ``step`` (0-based from ``origin``)."""
        start, stop = self.batch_span(step)
        return [p % self.num_samples for p in range(start, stop)]

    def samples_consumed(self, steps: int) -> int:
        """Global positions taken once every rank has taken ``steps`` steps."""
        if not 0 <= steps <= self.num_steps:
            raise ValueError(f"steps {steps} is outside the epoch's {self.num_steps} steps")
        consumed = self.origin + steps * self.total_batch_size
        return consumed if consumed < self.num_samples else self.num_samples  # min(), without a call per batch

    def steps_for(self, samples_consumed: int) -> int:
        """This rank's batches already taken when ``samples_consumed`` positions are gone.

        The inverse of :meth:`samples_consumed`; raises ``ValueError`` for a count
        that no step boundary of this plan produces.
        """
        done = samples_consumed - self.origin
        if done < 0 or samples_consumed > self.num_samples:
            raise ValueError(
                f"samples_consumed={samples_consumed} is outside [{self.origin}, {self.num_samples}]"
            )
        steps = _ceil_div(done, self.total_batch_size)
        if steps > self.num_steps or self.samples_consumed(steps) != samples_consumed:
            raise ValueError(
                f"samples_consumed={samples_consumed} does not fall on a step boundary of "
                f"{self.total_batch_size} samples per step from {self.origin}"
            )
        return min(steps, self.num_batches)

    @property
    def padding(self) -> int:
        """Samples repeated from the epoch's start to complete the last step (``even_batches``)."""
        if self.drop_last or not self.even_batches:
            return 0
        return self.num_steps * self.total_batch_size - self._remaining
