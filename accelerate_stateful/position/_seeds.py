"""Seeds derived from seeds: one well-spread 63-bit value per (seed, salts...), pure and deterministic."""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, *salts: int) -> int:
    """A well-spread 63-bit seed derived from ``seed`` and ``salts`` (splitmix64 rounds)."""
    x = seed & _MASK64
    for salt in salts:
        x = (x + 0x9E3779B97F4A7C15 + (salt & _MASK64)) & _MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        x ^= x >> 31
    return x >> 1
