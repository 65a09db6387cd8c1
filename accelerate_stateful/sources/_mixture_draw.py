"""Pure arithmetic of a mixture: which source global sample ``k`` comes from, and the weight schedule.

The source of sample ``k`` is a pure function of ``(seed, epoch, k)`` and the weights in effect at
``k``: a counter-based hash (SplitMix64's finalizer) of ``(seed, epoch, k)`` gives a uniform ``u`` in
``[0, 1)``, and ``u`` falls into one source's slice of the cumulative normalized weights (sources in
sorted name order, so the order of a mapping does not matter). No RNG state is carried from one sample to
the next, so any share can draw any ``k`` without drawing the ones before it, and the draws are the same
on every topology. The draws are independent: the realized proportions are multinomial around the
weights (``docs/sources/mixture.md`` gives the measured spread).

The schedule is a list of ``[from_index, plan]`` entries, ascending: the plan (weights, or a ``Stages`` or
``Ramp`` schedule of them, ``schedule.py``) of the last entry whose ``from_index`` is at most ``k`` is in
effect at ``k``, and gives the weights of ``k``.
"""

from __future__ import annotations

import bisect
import math
import numbers
from typing import Any, Mapping

from ..errors import UnsupportedConfigError

_MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def _mix(z: int) -> int:
    z = (z + GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def draw_key(seed: int, epoch: int) -> int:
    """The key of an epoch's draws: ``uniform(key, k)`` is sample ``k``'s uniform."""
    return _mix(_mix(int(seed) & _MASK) ^ (int(epoch) & _MASK))


def uniform(key: int, k: int) -> float:
    """A uniform in ``[0, 1)``, a pure function of ``key`` and ``k`` (53 bits of a SplitMix64 output)."""
    return (_mix((key + k * GOLDEN) & _MASK) >> 11) * (1.0 / (1 << 53))


class Table:
    """One weights entry, ready to draw from: the source a uniform ``u`` falls on."""

    def __init__(self, weights: Mapping[str, float]) -> None:
        self.names = sorted(weights)
        total = math.fsum(weights.values())
        cumulative, running = [], 0.0
        for name in self.names:
            running += weights[name] / total
            cumulative.append(running)
        last = max(i for i, name in enumerate(self.names) if weights[name] > 0)
        cumulative[last:] = [1.0] * (len(cumulative) - last)  # u < 1 lands on a positive weight, whatever the rounding
        self.cumulative = cumulative  # source i takes the uniforms below cumulative[i] (and above the one before)

    def pick(self, u: float) -> str:
        return self.names[bisect.bisect_right(self.cumulative, u)]


def proportions(weights: Mapping[str, float]) -> dict[str, float]:
    """The weights normalized to sum to 1 (what decides the draws: ``{a: 1, b: 1}`` equals ``{a: 2, b: 2}``)."""
    total = math.fsum(weights.values())
    return {name: weights[name] / total for name in sorted(weights)}


def show_weights(weights: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{name}: {weights[name]:g}" for name in sorted(weights)) + "}"


def same_weights(a: Mapping[str, float], b: Mapping[str, float]) -> bool:
    """Whether two weights draw the same sources (a source missing from one has weight 0 there)."""
    names = set(a) | set(b)
    return proportions({n: a.get(n, 0.0) for n in names}) == proportions({n: b.get(n, 0.0) for n in names})


def check_weights(weights: Any, names: list[str], where: str) -> dict[str, float]:
    """``weights`` as a plain ``{name: float}`` over exactly ``names``, or a refusal in the user's terms."""
    if not isinstance(weights, Mapping):
        raise UnsupportedConfigError(
            f"{where}: weights must be a mapping from source name to weight, like {{'{names[0]}': 1.0}}; "
            f"got {type(weights).__name__}"
        )
    unknown, missing = sorted(set(weights) - set(names)), sorted(set(names) - set(weights))
    if unknown or missing:
        raise UnsupportedConfigError(
            f"{where}: the weights must name exactly the sources {names}; "
            + (f"no source is called {unknown}" if unknown else "")
            + ("; " if unknown and missing else "")
            + (f"no weight given for {missing}" if missing else "")
            + " (give weight 0 to a source that should not be drawn)"
        )
    found = {}
    for name in names:
        value = weights[name]
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
            raise UnsupportedConfigError(
                f"{where}: the weight of source '{name}' is {value!r}; weights must be finite numbers >= 0"
            )
        found[name] = float(value)
    if not any(found.values()):
        raise UnsupportedConfigError(
            f"{where}: every weight is 0, so no source can be drawn; give at least one source a positive weight"
        )
    return found


def in_effect(schedule: list, k: int) -> int:
    """The index in ``schedule`` of the entry in effect at sample ``k``."""
    return bisect.bisect_right([entry[0] for entry in schedule], k) - 1
