"""Weight schedules of a ``Mixture``: the weights of global sample ``k`` as a pure function of ``k``.

``Stages`` holds weights from given indices on; ``Ramp`` moves linearly from one set of weights to another,
evaluated per block of ``block`` samples (the weights of sample ``k`` are the ramp's at ``k`` rounded down to a
multiple of ``block``). Neither depends on the rank, the number of processes or of workers, so every share
draws the same sequence. In a checkpoint a schedule is plain JSON (:func:`plan_json`): weights are a mapping
``{name: weight}``, as before schedules existed, a ``Stages`` is ``{"stages": [[start, plan], ...]}`` and a
``Ramp`` ``{"ramp": {"start", "end", "from", "to", "block"}}``.
"""

from __future__ import annotations

import bisect
import json
import numbers
from typing import Any, Mapping, Sequence, Union

from ..errors import UnsupportedConfigError
from ._mixture_draw import Table, check_weights, draw_key, in_effect, same_weights, show_weights, uniform

NEVER = float("inf")  # the end of a span of weights that never change


class Ramp:
    """Weights that move linearly from ``w_from`` (up to sample ``start``) to ``w_to`` (from sample ``end`` on).

    The weights of global sample ``k`` are the ramp's at ``b``, ``k`` rounded down to a multiple of ``block``:
    ``w_from + (w_to - w_from) * (b - start) / (end - start)``, with ``b`` held within ``[start, end]``. So the
    weights change once per block of ``block`` samples (``block=1``: at every sample).

    Examples:
        >>> Ramp(0, 10_240, {"web": 1, "code": 0}, {"web": 0.5, "code": 0.5}).weights_at(5_120)
        {'code': 0.25, 'web': 0.75}
    """

    def __init__(self, start: int, end: int, w_from: Mapping[str, float], w_to: Mapping[str, float], *,
                 block: int = 1024) -> None:
        if not (_whole(start) and _whole(end) and start < end):
            raise UnsupportedConfigError(
                f"Ramp(start={start!r}, end={end!r}): pass whole numbers with 0 <= start < end, the global sample "
                "indices where the ramp begins and where it reaches its last weights"
            )
        if not _whole(block) or block < 1:
            raise UnsupportedConfigError(f"Ramp(block={block!r}): pass a whole number >= 1 of samples per block")
        names = sorted(w_from) if isinstance(w_from, Mapping) else []
        self.w_from = check_weights(w_from, names or ["name"], "Ramp: w_from")
        self.w_to = check_weights(w_to, names, "Ramp: w_to (it must name the sources of w_from)")
        self.start, self.end, self.block = int(start), int(end), int(block)

    def names(self) -> set:
        return set(self.w_from)

    def span(self, k: int) -> tuple[dict[str, float], float]:
        """The weights of sample ``k``, and the first index after ``k`` whose weights may differ."""
        at = min(max(k - k % self.block, self.start), self.end)  # the same for a whole block
        t = (at - self.start) / (self.end - self.start)
        weights = {name: self.w_from[name] + (self.w_to[name] - self.w_from[name]) * t for name in sorted(self.w_from)}
        return weights, NEVER if at == self.end else (max(k, self.start) // self.block + 1) * self.block

    def weights_at(self, k: int) -> dict[str, float]:
        """The weights global sample ``k`` is drawn with."""
        return self.span(k)[0]

    def to_json(self) -> dict:
        return {"ramp": {"start": self.start, "end": self.end, "from": dict(self.w_from), "to": dict(self.w_to),
                         "block": self.block}}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ramp) and self.to_json() == other.to_json()

    def __repr__(self) -> str:
        return (f"Ramp({self.start}, {self.end}, {show_weights(self.w_from)}, {show_weights(self.w_to)}, "
                f"block={self.block})")


class Stages:
    """Weights by stage: each stage's weights hold from its start to the next stage's start.

    ``stages`` is a list of ``(start, weights)``: the first starts at sample 0, the starts increase, and every
    stage names the same sources. A stage's weights may be a :class:`Ramp` (its weights at each sample).

    Examples:
        >>> s = Stages([(0, {"web": 1, "code": 0}), (10_000, {"web": 0.7, "code": 0.3})])
        >>> s.weights_at(9_999), s.weights_at(10_000)
        ({'code': 0.0, 'web': 1.0}, {'code': 0.3, 'web': 0.7})
    """

    def __init__(self, stages: Sequence[tuple[int, Union[Mapping[str, float], Ramp]]]) -> None:
        if isinstance(stages, (str, bytes, Mapping)) or not isinstance(stages, Sequence) or not stages or not all(
                isinstance(s, Sequence) and len(s) == 2 and _whole(s[0]) for s in stages):
            raise UnsupportedConfigError(
                f"Stages({str(stages)[:100]}): pass a non-empty list of (start, weights) pairs, a start being the "
                "global sample index (a whole number >= 0) from which those weights hold"
            )
        starts = [int(start) for start, _ in stages]
        if starts[0] != 0 or any(a >= b for a, b in zip(starts, starts[1:])):
            raise UnsupportedConfigError(
                f"Stages: the stages start at {starts}; the first must start at 0 and each later one after the one "
                "before it"
            )
        plans = [_stage_plan(plan, i) for i, (_, plan) in enumerate(stages)]
        first = _names(plans[0])
        for i, plan in enumerate(plans[1:], start=1):
            if _names(plan) != first:
                raise UnsupportedConfigError(
                    f"Stages: stage {i} (from sample {starts[i]}) names the sources {sorted(_names(plan))}, stage 0 "
                    f"{sorted(first)}; every stage must name the same sources (give weight 0 to leave one out)"
                )
        self.starts, self.plans = starts, plans

    def names(self) -> set:
        return _names(self.plans[0])

    def span(self, k: int) -> tuple[dict[str, float], float]:
        """The weights of sample ``k``, and the first index after ``k`` whose weights may differ."""
        i = bisect.bisect_right(self.starts, k) - 1
        weights, until = self.plans[i].span(k) if isinstance(self.plans[i], Ramp) else (dict(self.plans[i]), NEVER)
        return weights, min(until, self.starts[i + 1]) if i + 1 < len(self.starts) else until

    def weights_at(self, k: int) -> dict[str, float]:
        """The weights global sample ``k`` is drawn with."""
        return self.span(k)[0]

    def to_json(self) -> dict:
        return {"stages": [[start, plan_json(plan)] for start, plan in zip(self.starts, self.plans)]}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stages) and self.to_json() == other.to_json()

    def __repr__(self) -> str:
        shown = ", ".join(f"({start}, {show_plan(plan)})" for start, plan in zip(self.starts, self.plans))
        return f"Stages([{shown}])"


class Constant:
    """Fixed weights, as a plan: one piece."""

    def __init__(self, weights: Mapping[str, float]) -> None:
        self._weights = dict(weights)

    def span(self, k: int) -> tuple[dict[str, float], float]:
        return dict(self._weights), NEVER


Schedule = Union[Stages, Ramp]


def _stage_plan(plan: Any, i: int) -> Union[dict, Ramp]:
    if isinstance(plan, Ramp):
        return plan
    names = sorted(plan) if isinstance(plan, Mapping) else ["name"]
    return check_weights(plan, names, f"Stages: stage {i}")


def _names(plan: Any) -> set:
    return plan.names() if isinstance(plan, (Stages, Ramp)) else set(plan)


def _whole(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


def check_plan(plan: Any, names: list[str], where: str) -> Union[dict, Schedule]:
    """Weights or a schedule over exactly ``names`` (a copy of weights), or a refusal in the user's terms."""
    if not isinstance(plan, (Stages, Ramp)):
        return check_weights(plan, names, where)
    if plan.names() != set(names):
        check_weights(dict.fromkeys(plan.names(), 1.0), names, f"{where}: {type(plan).__name__}")  # says which
    return plan


def plan_json(plan: Any) -> Any:
    """The plain JSON form of weights or a schedule, as a checkpoint records it."""
    return plan.to_json() if isinstance(plan, (Stages, Ramp)) else dict(plan)


def plan_from_json(found: Any) -> Union[Constant, Schedule]:
    """The plan a checkpoint recorded; raises :class:`UnsupportedConfigError` (or ``ValueError``/``TypeError``/
    ``KeyError`` on a damaged form) for one it could not have written."""
    if not isinstance(found, Mapping):
        raise TypeError(f"a weights plan is a mapping, not {type(found).__name__}")
    if set(found) == {"stages"} and isinstance(found["stages"], list):
        return Stages([(start, _inner(plan)) for start, plan in found["stages"]])
    if set(found) == {"ramp"} and isinstance(found["ramp"], Mapping):
        r = found["ramp"]
        if set(r) != {"start", "end", "from", "to", "block"}:
            raise KeyError(sorted(r))
        return Ramp(r["start"], r["end"], r["from"], r["to"], block=r["block"])
    return Constant(check_weights(found, sorted(found) or ["name"], "saved weights"))


def _inner(found: Any) -> Union[dict, Ramp]:
    plan = plan_from_json(found)
    if isinstance(plan, Stages):
        raise ValueError("a stage's weights are weights or a ramp, not stages")
    return plan.span(0)[0] if isinstance(plan, Constant) else plan


def plan_names(found: Any) -> set:
    """The source names of a recorded plan (well formed)."""
    plan = plan_from_json(found)
    return set(plan.span(0)[0]) if isinstance(plan, Constant) else plan.names()


def same_plan(a: Any, b: Any) -> bool:
    """Whether two recorded plans draw the same (weights: proportional ones are the same)."""
    if isinstance(plan_from_json(a), Constant) and isinstance(plan_from_json(b), Constant):
        return same_weights(a, b)
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def show_plan(plan: Any) -> str:
    """Weights or a schedule (or its recorded form) as the user wrote it."""
    if isinstance(plan, (Stages, Ramp)):
        return repr(plan)
    found = plan_from_json(plan)
    return show_weights(plan) if isinstance(found, Constant) else repr(found)


def extend(schedule: list, at: int, plan: Any) -> list:
    """``schedule`` with the recorded ``plan`` in effect from sample ``at`` on (unchanged if already in effect).

    An entry at or after ``at`` was never drawn from (``at`` is where the shares stand), so it is replaced.
    """
    kept = [list(entry) for entry in schedule if entry[0] < at]
    if kept and same_plan(kept[-1][1], plan):
        return kept
    return kept + [[int(at), plan]]


class Picker:
    """The source a mixture draws for global sample ``k`` under a recorded schedule, in ``epoch``: what its
    cursor reads (``mixture._Cursor``) and what ``accelerate-stateful samples`` names, without reading a source.

    One table of weights is kept for the span of indices it holds for (a stage, a ramp's block), so a run of
    consecutive ``k`` builds a table per span, not per sample.
    """

    def __init__(self, seed: int, epoch: int, schedule: list) -> None:
        self._key = draw_key(seed, epoch)
        self._schedule = schedule
        self._plans = [plan_from_json(plan) for _, plan in schedule]
        self._table: Union[Table, None] = None
        self._from, self._until = 0, -1.0  # the indices [from, until) self._table draws for (none yet)

    @property
    def key(self) -> int:
        """The epoch's draw key: sample ``k``'s uniform is ``uniform(key, k)``."""
        return self._key

    def __call__(self, k: int) -> str:
        return self.table(k).pick(uniform(self._key, k))

    def table(self, k: int) -> Table:
        """The table sample ``k`` draws from; it holds up to :attr:`until` (exclusive)."""
        if not self._from <= k < self._until:
            entry = in_effect(self._schedule, k)
            weights, until = self._plans[entry].span(k)
            if entry + 1 < len(self._schedule):
                until = min(until, self._schedule[entry + 1][0])
            self._table, self._from, self._until = Table(weights), k, until
        return self._table

    @property
    def until(self) -> float:
        return self._until
