"""The draws of a ``Shuffled`` buffer, apart from the buffer: ``accelerate-stateful samples`` replays them
without importing torch (``shuffle.py`` imports it with the stream machinery of ``_global``)."""

from __future__ import annotations

import numpy as np

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
