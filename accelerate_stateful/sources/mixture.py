"""``Mixture``: a weighted draw from named sources, the same global sequence on every topology."""

from __future__ import annotations

import copy
from typing import Any, Callable, Mapping, Optional, Union

from torch.utils.data import get_worker_info

from .. import _log
from ._global import GlobalStream, check_child, check_source, open_source
from ._mixture_draw import in_effect
from ._mixture_state import checked_position, schedule_of, source_counts, start_position, token_count
from .schedule import Picker, Ramp, Schedule, Stages, check_plan, extend, plan_json, same_plan, show_plan
from ..errors import CheckpointError, UnsupportedConfigError

logger = _log.get_logger(__name__)

STOP, RESTART = "stop", "restart"


class Mixture(GlobalStream):
    """Draws each sample from one of several named sources, with the given weights.

    Global sample ``k`` comes from the source that a counter-based hash of ``(seed, epoch, k)`` picks under
    the weights in effect at ``k`` (see ``docs/sources/mixture.md``); it is that source's next item, read
    in the source's own order. Nothing depends on the rank, the number of processes or of workers, so a
    resume on another topology continues the same sequence; each ``DataLoader`` worker reads every drawn
    item and keeps its share (``GlobalStream``).

    Sources: map-style datasets (a list, a ``datasets.Dataset``; read in index order), stateful iterables
    (a ``datasets.IterableDataset``, read whole, or anything with ``state_dict()``/``load_state_dict()``),
    and the package's other sources.

    When a drawn source has no item left, ``on_exhausted="stop"`` (the default) ends the epoch there;
    ``"restart"`` reads that source again from its start and goes on (the epoch then ends after
    ``samples_per_epoch`` samples, or never).

    ``weights`` may be a schedule instead, weights as a pure function of the global sample index:
    :class:`Stages` and :class:`Ramp`, e.g. ``Mixture(sources, Stages([(0, w0), (10_000, w1)]))``.

    Weights change with :meth:`set_weights`, or by passing other weights to ``Mixture(...)`` on a resume:
    they take effect from the next pass's first sample that no worker has read (a resumed epoch), or from
    the next epoch's start, and the checkpoint records them as a schedule.

    State dict (under ``GlobalStream``'s ``{"index", "position"}``; ``position``):
        next: the global index of the next sample.
        seed: the seed of the draws (absent from a checkpoint written before it was recorded; a resume with
            another seed is refused, since every later sample would come from other sources).
        schedule: ``[[from_index, plan], ...]``, the weights in effect from each index on: a plan is
            ``{name: weight}``, or a ``Stages``/``Ramp`` schedule's JSON form (``schedule.plan_json``).
        sources: each source's position (its next index, or its own ``state_dict()``; ``None``: its start).
        drawn: per source, the samples drawn from it in this epoch (its next index in its own order).
        delivered: per source, the samples this worker's share delivered in this epoch.
        restarts: per source, how many times it was read again from its start.
        tokens: per source, the tokens of the samples this worker's share delivered (``token_count``: the
            length of a list or 1-d tensor of token ids, or of a dict's ``input_ids``); read as 0 when absent
            (a position written before tokens were counted).

    Examples:
        >>> mix = Mixture({"web": web, "code": code}, {"web": 0.7, "code": 0.3}, seed=1)  # doctest: +SKIP
        >>> dl = accelerator.prepare(DataLoader(mix, batch_size=8, num_workers=2))        # doctest: +SKIP
    """

    def __init__(
        self,
        sources: Mapping[str, Any],
        weights: Union[Mapping[str, float], Schedule],
        *,
        seed: int = 0,
        on_exhausted: str = STOP,
        samples_per_epoch: Optional[int] = None,
    ) -> None:
        if not isinstance(sources, Mapping) or not sources or not all(isinstance(n, str) for n in sources):
            raise UnsupportedConfigError(
                "Mixture needs its sources as a non-empty mapping from a name (a str) to a dataset, like "
                "{'web': web_dataset, 'code': code_dataset}"
            )
        for name, source in sources.items():
            _check_source(name, source)
        if on_exhausted not in (STOP, RESTART):
            raise UnsupportedConfigError(
                f"Mixture(on_exhausted={on_exhausted!r}): pass 'stop' (end the epoch when a drawn source has no "
                "item left) or 'restart' (read that source again from its start)"
            )
        if samples_per_epoch is not None and (isinstance(samples_per_epoch, bool)
                                              or not isinstance(samples_per_epoch, int) or samples_per_epoch < 0):
            raise UnsupportedConfigError(
                f"Mixture(samples_per_epoch={samples_per_epoch!r}): pass a whole number >= 0, or None for no limit"
            )
        self.sources = dict(sources)
        self.names = sorted(self.sources)
        self._plan = check_plan(weights, self.names, "Mixture")
        self.seed = int(seed)
        self.on_exhausted = on_exhausted
        self.samples_per_epoch = samples_per_epoch

    @property
    def weights(self) -> Union[dict[str, float], Schedule]:
        """The weights, or the schedule, the next pass starts with (a pass in progress keeps its own: see
        :meth:`set_weights`)."""
        return self._plan if isinstance(self._plan, (Stages, Ramp)) else dict(self._plan)

    def set_weights(self, weights: Union[Mapping[str, float], Schedule]) -> None:
        """Draw with ``weights`` (or a ``Stages``/``Ramp`` schedule) from the next pass on.

        Under the package's loader (``accelerator.prepare``) the new weights reach every worker, persistent
        ones too, at the start of the next pass: the next epoch from its first sample, or the epoch a
        checkpoint resumes, from the first sample no worker had read (recorded in the checkpoint's schedule).
        A pass in progress keeps the weights it started with: every worker reads every drawn sample, and
        they can only agree on a switch point when a pass starts. Iterated directly (no loader), the next
        ``iter()`` starts with them. A plain torch ``DataLoader`` with ``persistent_workers=True`` keeps the
        copies its workers started with: prepare it, or use ``persistent_workers=False``. Like every setting
        of the data, the weights must be the same on every process: call it on each, with the same weights.

        Raises:
            UnsupportedConfigError: a weight is negative or not a number, all are 0, or the names are not
                exactly this mixture's sources.
        """
        self._plan = check_plan(weights, self.names, "Mixture.set_weights")

    # ------------------------------------------------------------------ GlobalStream
    def settings(self) -> dict[str, Any]:
        return {"weights": show_plan(self._plan), "seed": self.seed, "on_exhausted": self.on_exhausted,
                "samples_per_epoch": self.samples_per_epoch}

    def children(self) -> dict[str, Any]:
        return {f"source '{name}'": self.sources[name] for name in self.names}

    def check_position(self, position: Any) -> None:
        found = checked_position(position, self.names)
        self._check_seed(position)
        for name in self.names:
            check_child(self.sources[name], found["sources"][name])

    def _check_seed(self, position: dict) -> None:
        saved = position.get("seed", self.seed)  # (not recorded before ``samples`` named a mixture's documents)
        if saved != self.seed:
            raise CheckpointError(
                f"the checkpoint's Mixture drew its sources with seed={saved!r}, this one draws with seed={self.seed}, "
                f"so every sample after the resume would come from other sources; resume with Mixture(..., "
                f"seed={saved!r}), or start a fresh run"
            )

    def open(self, position: Optional[Any], epoch: int) -> "_Cursor":
        if position is None:
            return _Cursor(self, start_position(self.names, plan_json(self._plan)), epoch)
        found = checked_position(position, self.names)
        self._check_seed(position)
        if not position.get("agreed") and not same_plan(found["schedule"][-1][1], plan_json(self._plan)):
            found["schedule"] = self._switch_alone(found)
        return _Cursor(self, found, epoch)

    def _switch_alone(self, position: dict) -> list:
        """The saved schedule extended with this mixture's weights, for a position no loader agreed on."""
        info = get_worker_info()
        if info is not None and info.num_workers > 1:
            raise UnsupportedConfigError(
                f"the Mixture's weights changed since the checkpoint ({show_plan(position['schedule'][-1][1])}"
                f" -> {show_plan(self._plan)}), and {info.num_workers} DataLoader workers resume it, each "
                "from its own sample; without accelerate_stateful's loader they cannot agree where to switch. "
                "Prepare the DataLoader with accelerator.prepare, or resume with the saved weights"
            )
        at = position["next"]
        schedule = extend(position["schedule"], at, plan_json(self._plan))
        logger.warning("Mixture: %s", _change_line(position["schedule"], at, self._plan))
        return schedule

    def agree(self, positions: list) -> tuple[list, list[str]]:
        """Every share starts the pass with the same schedule, this mixture's weights from one index on.

        A fresh pass starts with the current weights. A resumed one switches to them, if they differ from
        the saved ones, at the largest next index among the shares: the first sample no share has read.
        The samples below it that a lagging share has yet to deliver keep the saved weights, since the
        shares ahead of it drew past them with those weights.
        """
        if all(position is None for position in positions):
            agreed = [dict(start_position(self.names, plan_json(self._plan)), agreed=True) for _ in positions]
            return self._agree_children(agreed, [])
        found = [None if position is None else checked_position(position, self.names) for position in positions]
        saved = schedule_of([position for position in found if position is not None])
        at = max(position["next"] for position in found if position is not None)
        schedule = extend(saved, at, plan_json(self._plan))
        lines = [] if schedule == saved else [f"Mixture: {_change_line(saved, at, self._plan)}"]
        agreed = []
        for position in found:
            position = position if position is not None else start_position(self.names, plan_json(self._plan))
            agreed.append(dict(position, schedule=copy.deepcopy(schedule), agreed=True))
        return self._agree_children(agreed, lines)

    def _agree_children(self, agreed: list, lines: list[str]) -> tuple[list, list[str]]:
        """Pass ``agree`` on to the sources that are global sequences (a mixture of mixtures)."""
        for name in self.names:
            source = self.sources[name]
            if not isinstance(source, GlobalStream):
                continue
            below, said = source.agree([position["sources"][name] for position in agreed])
            for position, child in zip(agreed, below):
                position["sources"][name] = child
            lines = lines + [f"source '{name}': {line}" for line in said]
        return agreed, lines

    # ------------------------------------------------------------------ accounting
    def delivered(self, state: Optional[Any] = None) -> dict[str, int]:
        """Per source, the samples delivered in the epoch.

        Args:
            state: A ``state_dict()`` of this mixture, a list of them (one per worker share), or a state of
                the package's loader over it (one rank's: every rank reads the whole stream, so its shares
                account for every rank's samples). ``None``: this object's own position (the samples it
                delivered when iterated in this process).
        """
        return self._counted(state, "samples")

    def tokens(self, state: Optional[Any] = None) -> dict[str, int]:
        """Per source, the tokens of the samples delivered in the epoch: the length of each item that has one
        (a list, tuple or 1-d tensor of token ids, or a dict's ``input_ids``; other items count 0). ``state``
        as for :meth:`delivered`."""
        return self._counted(state, "tokens")

    def _counted(self, state: Optional[Any], key: str) -> dict[str, int]:
        counts = source_counts(self.state_dict() if state is None else state)
        return {name: counts.get(name, {}).get(key, 0) for name in sorted(set(self.names) | set(counts))}


class _Cursor:
    """The mixture's sequence from a position: draws a source for each index, reads that source's next item."""

    def __init__(self, mixture: Mixture, position: dict, epoch: int) -> None:
        self._sources, self._epoch = mixture.sources, epoch
        self._restart, self._limit = mixture.on_exhausted == RESTART, mixture.samples_per_epoch
        self._seed, self._schedule = mixture.seed, position["schedule"]
        self._pick = Picker(mixture.seed, epoch, self._schedule)
        self._k = position["next"]
        self._saved = position["sources"]  # positions of the sources not opened yet
        self._cursors: dict[str, Any] = {}
        self._drawn, self._delivered = dict(position["drawn"]), dict(position["delivered"])
        self._restarts, self._tokens = dict(position["restarts"]), dict(position["tokens"])
        self._keeps: Optional[Callable[[int], bool]] = None

    def split(self, keeps: Callable[[int], bool]) -> None:
        self._keeps = keeps

    def __next__(self) -> Any:
        k = self._k
        if self._limit is not None and k >= self._limit:
            raise StopIteration
        name = self._pick(k)
        item = self._read(name)  # StopIteration: a drawn source ended, and so does the epoch
        self._k = k + 1
        self._drawn[name] += 1
        if self._keeps is None or self._keeps(k):
            self._delivered[name] += 1
            self._tokens[name] += token_count(item)
        return item

    def _read(self, name: str) -> Any:
        cursor = self._cursors.get(name)
        if cursor is None:
            cursor = self._cursors[name] = open_source(self._sources[name], self._saved[name], self._epoch)
        try:
            return next(cursor)
        except StopIteration:
            if not self._restart:
                raise
        self._restarts[name] += 1
        cursor = self._cursors[name] = open_source(self._sources[name], None, self._epoch)
        try:
            return next(cursor)
        except StopIteration:
            raise UnsupportedConfigError(
                f"Mixture source '{name}' has no items, so on_exhausted='restart' cannot read it again; give it "
                "weight 0 or remove it"
            ) from None

    def position(self) -> dict:
        sources = {
            name: self._cursors[name].position() if name in self._cursors else _unagreed(saved)
            for name, saved in self._saved.items()
        }
        return {
            "next": self._k,
            "seed": self._seed,
            "schedule": copy.deepcopy(self._schedule),
            "sources": sources,
            "drawn": dict(self._drawn),
            "delivered": dict(self._delivered),
            "restarts": dict(self._restarts),
            "tokens": dict(self._tokens),
        }


def _unagreed(saved: Any) -> Any:
    """A copy of a source's saved position, without the mark that a pass's agreement left on it."""
    found = copy.deepcopy(saved)
    if isinstance(found, dict):
        found.pop("agreed", None)
    return found


def _change_line(schedule: list, at: int, plan: Any) -> str:
    before = show_plan(schedule[in_effect(schedule, at)][1]) if schedule and schedule[0][0] <= at else "{}"
    return (f"weights change from global sample {at} on: {before} -> {show_plan(plan)} "
            "(the samples before it keep the saved weights; nothing any source delivered is read again or lost)")


def _check_source(name: str, source: Any) -> None:
    check_source(source, f"Mixture source '{name}'")

