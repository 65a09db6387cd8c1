"""The draws of a ``Shuffled`` buffer, apart from the buffer: ``accelerate-stateful samples`` replays them
without importing torch (``shuffle.py`` imports it with the stream machinery of ``_global``).

While the buffer is full and its source goes on, draw ``t`` refills slot ``draw(t) % buffer_size`` with the next
item read, so the slots after a later draw follow from the slots at an earlier one and the draws alone
(:class:`Anchor`, :class:`Replayed`): a record taken after every batch holds the draw count, not a copy of the slots.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._recorded import Deferred

_BLOCK = 1024  # draws made at a time; draw t is block t // _BLOCK, element t % _BLOCK


class Draws:
    """A counter-based stream of 64-bit draws: draw ``t`` depends on ``(seed, epoch, t)`` only.

    Block ``b`` is PCG64's raw output seeded by ``SeedSequence([seed, epoch, b])``, which numpy
    keeps the same across versions; the generator's position is therefore the count ``t`` alone.
    """

    def __init__(self, seed: int, epoch: int) -> None:
        self._key, self._block, self._values = (seed, epoch), -1, []

    def __call__(self, t: int) -> int:
        block = t // _BLOCK
        if block != self._block:
            self._block, self._values = block, _block(*self._key, block).tolist()
        return self._values[t % _BLOCK]


def first_draws(seed: int, epoch: int, count: int) -> np.ndarray:
    """Draws ``0 .. count - 1`` of :class:`Draws` ``(seed, epoch)`` at once, as ``uint64``."""
    blocks = [_block(seed, epoch, b) for b in range(-(-count // _BLOCK))]
    return np.concatenate(blocks)[:count] if blocks else np.zeros(0, dtype=np.uint64)


def _block(seed: int, epoch: int, block: int) -> np.ndarray:
    return np.random.PCG64(np.random.SeedSequence([seed, epoch, block])).random_raw(_BLOCK)


class Anchor:
    """A full buffer's slots after ``draws`` draws (``read`` items read), its source going on: the slots after
    each later draw of that stretch are these with the draws since replayed (:class:`Replayed`)."""

    __slots__ = ("slots", "draws", "read", "key")

    def __init__(self, slots: Any, draws: int, read: int, seed: int, epoch: int) -> None:
        self.slots, self.draws, self.read, self.key = slots, draws, read, (seed, epoch)  # slots: a private copy

    def serves(self, draws: int, read: int) -> bool:
        """Whether the full buffer's slots after ``draws`` draws (``read`` items read) are replayed from here in
        fewer draws than the buffer holds: so a record costs at most one slot copied per draw, and reading it
        replays at most ``buffer_size`` draws."""
        since = draws - self.draws
        return 0 <= since < len(self.slots) and read - self.read == since


class Replayed(Deferred):
    """The slots of a full buffer after ``draws`` draws, as a tuple only when read (``_recorded``)."""

    __slots__ = ("_anchor", "_draws")

    def __init__(self, anchor: Anchor, draws: int) -> None:
        self._anchor, self._draws = anchor, draws

    def settled(self) -> tuple:
        anchor = self._anchor
        slots, size, number = anchor.slots[:], len(anchor.slots), anchor.read
        draw = Draws(*anchor.key)  # its own: a worker's reply thread reads a record while the buffer draws on
        for t in range(anchor.draws, self._draws):
            slots[draw(t) % size] = number
            number += 1
        return tuple(slots)
