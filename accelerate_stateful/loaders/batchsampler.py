"""The batch-sampler loader: a user's own ``batch_sampler``, sharded as Accelerate shards it."""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
from torch.utils.data import BatchSampler, DataLoader, Sampler

from ..checkpoint import _state as S
from ._adapter import DataLoaderAdapter
from .._context import DistContext
from ..position._deal import Step, deal, rank_batches
from ..position._order import mix_seed
from ..training._rng import PipelineRNG
from ._refetch import fetched_again
from ..position._sampler_rng import LEGACY_PATHS, drawn_twice, fingerprint, reseed, user_seed
from ..checkpoint import _refusals
from ._ordered import require_in_order
from ..errors import CheckpointError, UnsupportedConfigError

CONSUMED = "batches_consumed"
STEPS = "steps_taken"
_WORKER_SALT = 0x5EED


def uses_batch_sampler(dataloader: DataLoader) -> bool:
    """Whether a loader draws whole batches from a user's sampler (``batch_sampler=``, or one as ``sampler=``)."""
    return dataloader.batch_size is None and (
        dataloader.batch_sampler is not None or isinstance(dataloader.sampler, BatchSampler)
    )


def draw_batches(batch_sampler: Any, seed: int, epoch: int, skip: Sequence[Any] = ()) -> list[list[int]]:
    """Every batch ``batch_sampler`` draws in ``epoch``: a pure function of (seed, epoch).

    The sampler (and the sampler it wraps, if any) gets ``set_epoch(epoch)`` when it has one; every RNG
    they hold under any attribute name (``_sampler_rng``), and torch's global RNG, are seeded from (seed,
    epoch) while it is drawn, so a sampler that shuffles with any of them is reproduced exactly. This is the
    one place the epoch's batches are drawn: any further RNG a sampler may use belongs here.
    """
    for part in (batch_sampler, getattr(batch_sampler, "sampler", None)):
        if hasattr(part, "set_epoch"):
            part.set_epoch(epoch)
    reseed(batch_sampler, seed, epoch, skip)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(mix_seed(seed, epoch, 1))
        return [list(map(int, batch)) for batch in batch_sampler]


class _RankBatches(Sampler[list[int]]):
    """Feeds the base loader this rank's batches of one pass."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class BatchSamplerDataLoader(DataLoaderAdapter):
    """Each rank reads its batches of a user's ``batch_sampler``, exactly as Accelerate deals them.

    The epoch's batches are drawn once per epoch from the sampler (length
    bucketing, token budgets, shuffled or not) as a pure function of (seed,
    epoch), and dealt to the ranks as ``BatchSamplerShard`` deals them (see
    ``_deal``). The position is the number of global steps taken, the same on
    every rank; on another world size the sampler's batches nobody took are
    dealt again to the new ranks.

    State dict (besides the common keys):
        batches_consumed: The sampler's batches of the epoch used up by the steps taken.
        stripe_origin: How many of the epoch's batches were dealt before the current dealing began.
        steps_taken: Global steps taken since ``stripe_origin``.
    """

    mode = S.BATCH_SAMPLER_MODE

    def __init__(
        self,
        dataset: Any,
        batch_sampler: Any,
        *,
        ctx: DistContext,
        seed: int,
        seed_source: str,
        as_sampler: bool = False,
        even_batches: bool = True,
        split_batches: bool = False,
        device: Optional[torch.device] = None,
        non_blocking: bool = False,
        pipeline_rng: str = "auto",
        **loader_settings: Any,
    ) -> None:
        require_in_order(loader_settings)
        self._user_sampler = batch_sampler
        self._sampler_batch_size = getattr(batch_sampler, "batch_size", None)
        self._drop_last = bool(getattr(batch_sampler, "drop_last", False))
        self._even_batches = even_batches
        self._split_batches = split_batches
        self._check_split(ctx.world_size)
        self._feed = _RankBatches()
        self._worker_generator = torch.Generator()
        feed = {"sampler": self._feed, "batch_size": None} if as_sampler else {"batch_sampler": self._feed}
        base = DataLoader(dataset, generator=self._worker_generator, **feed, **loader_settings)
        super().__init__(base, ctx, seed=seed, seed_source=seed_source, device=device, non_blocking=non_blocking)
        self._as_sampler = as_sampler
        self._pipeline = PipelineRNG(pipeline_rng, self.num_workers, dataset, whole_batches=as_sampler)
        self._origin = 0
        self._steps = 0
        self._cache: tuple[Any, Any] = (None, None)
        # The first epoch is drawn twice, here at construction (``prepare``, which every process reaches): an
        # order that differs cannot be resumed, and every process refuses it at the same point, never at the
        # first ``len(dl)`` that one process alone may make.
        self._checked = False
        self._epoch_batches()

    @classmethod
    def from_dataloader(
        cls,
        dataloader: DataLoader,
        ctx: Optional[DistContext] = None,
        *,
        device: Optional[torch.device] = None,
        non_blocking: bool = False,
        split_batches: bool = False,
        even_batches: bool = True,
        data_seed: Optional[int] = None,
        pipeline_rng: str = "auto",
    ) -> "BatchSamplerDataLoader":
        """Build the loader that replaces a user's ``DataLoader(batch_sampler=...)`` in ``prepare``."""
        from ..position._order import choose_seed
        from .shard import loader_settings

        ctx = ctx if ctx is not None else DistContext.detect()
        as_sampler = dataloader.batch_sampler is None
        batch_sampler = dataloader.sampler if as_sampler else dataloader.batch_sampler
        seed, seed_source = _sampler_seed(batch_sampler, dataloader.dataset)
        if data_seed is not None or seed_source != "generator":
            seed, seed_source = choose_seed(dataloader, data_seed, ctx)
        settings = loader_settings(dataloader)
        return cls(
            dataloader.dataset, batch_sampler, ctx=ctx, seed=seed, seed_source=seed_source, as_sampler=as_sampler,
            even_batches=even_batches, split_batches=split_batches, device=device, non_blocking=non_blocking,
            pipeline_rng=pipeline_rng, **settings,
        )

    def _check_split(self, world: int, where: str = "") -> None:
        size = self._sampler_batch_size
        if self._split_batches and world > 1 and (not isinstance(size, int) or size % world):
            raise UnsupportedConfigError(
                f"cannot {'resume' + where if where else 'shard'} {type(self._user_sampler).__name__} with "
                f"split_batches=True on {world} processes: each of its batches is cut into {world} equal slices, "
                f"which needs a batch_size attribute divisible by {world} (it has batch_size={size!r}); set "
                "split_batches=False, or give the sampler such a batch_size"
            )

    # ----------------------------------------------------------------- forwarded by name
    @property
    def batch_size(self) -> Optional[int]:
        """The sampler's ``batch_size`` attribute, per rank (``None`` for batches of any length)."""
        size = self._sampler_batch_size
        return size // self.ctx.world_size if size is not None and self._split_batches else size

    @property
    def total_batch_size(self) -> Optional[int]:
        size = self._sampler_batch_size
        return size if size is None or self._split_batches else size * self.ctx.world_size

    @property
    def drop_last(self) -> bool:
        return self._drop_last

    @property
    def batch_sampler(self) -> Any:
        """The user's batch sampler (it draws every rank's batches; this rank takes its share)."""
        return self._user_sampler

    def __len__(self) -> int:
        return len(rank_batches(self._steps_of_epoch(), self.ctx.rank))

    # ----------------------------------------------------------------- position hooks
    def _epoch_batches(self, key: Optional[tuple[int, int]] = None) -> list[list[int]]:
        """The batches the sampler draws in epoch ``key = (seed, epoch)`` (the current one by default)."""
        key = (self._seed, self._epoch) if key is None else key
        if self._cache[0] != key:
            skip = (self._base.dataset,)
            draw = lambda: draw_batches(self._user_sampler, *key, skip)  # noqa: E731
            batches = draw() if self._checked else drawn_twice(draw, type(self._user_sampler).__name__)
            self._checked = True
            self._cache = (key, (batches, {}, fingerprint(batches)))
        return self._cache[1][0]

    def _steps_of_epoch(
        self, origin: Optional[int] = None, world: Optional[int] = None, key: Optional[tuple[int, int]] = None
    ) -> list[Step]:
        """The global steps of epoch ``key`` from ``origin`` at ``world`` processes (memoised per epoch)."""
        origin = self._origin if origin is None else origin
        world = self.ctx.world_size if world is None else world
        batches = self._epoch_batches(key)
        dealt = self._cache[1][1]
        if (origin, world) not in dealt:
            dealt[(origin, world)] = deal(
                batches, world_size=world, split_batches=self._split_batches, even_batches=self._even_batches,
                drop_last=self._drop_last, batch_size=self._sampler_batch_size, origin=origin,
            )
        return dealt[(origin, world)]

    def _consumed(self) -> int:
        return self._steps_of_epoch()[self._steps - 1].consumed if self._steps else self._origin

    def _batches(self) -> Iterator[Any]:
        own = rank_batches(self._steps_of_epoch(), self.ctx.rank, self._steps)
        last = own[-1][0] if own else None
        for step, batch in self._open_pass(read_ahead=False):
            self._commit(step)
            self.end_of_dataloader = step == last
            yield self._place(batch)

    def _open_pass(self, read_ahead: bool = True) -> Iterator[tuple[int, Any]]:
        own = rank_batches(self._steps_of_epoch(), self.ctx.rank, self._steps)
        # A rank's steps are consecutive (one without a batch at a step has none after it), so the fetch counts them
        # as the tags do.
        where = self._fetch_key(self._origin)
        tag = self._pipeline.tagger(where)
        self._feed.batches = [batch if tag is None else tag(step, batch) for step, batch in own]
        self._worker_generator.manual_seed(mix_seed(self._seed, self._epoch, _WORKER_SALT))
        fetched = self._pipeline.fetch(self._open_base(), where, own[0][0] if own else 0, read_ahead)
        for (step, _), batch in zip(own, fetched):
            yield step, batch

    def _commit(self, token: int) -> None:
        self._steps = token

    def _epoch_complete(self) -> bool:
        """This rank's last batch was handed out and every rank took every batch (the epoch's last global step)."""
        return self.end_of_dataloader and self._epoch_complete_at_restore()

    def _epoch_complete_at_restore(self) -> bool:
        steps = len(self._steps_of_epoch())
        return steps > 0 and self._steps >= steps

    def _batches_taken(self) -> int:
        return sum(1 for s in self._steps_of_epoch()[: self._steps] if s.batches[self.ctx.rank] is not None)

    def _position_state(self, mark: Optional[tuple] = None) -> dict:
        epoch, origin, steps = self._position_mark() if mark is None else mark
        dealt = self._steps_of_epoch(origin, key=(self._seed, epoch))
        taken = sum(1 for s in dealt[:steps] if s.batches[self.ctx.rank] is not None)
        return {CONSUMED: dealt[steps - 1].consumed if steps else origin, S.STRIPE_ORIGIN: origin, STEPS: steps,
                S.BATCHES_YIELDED: taken, S.ORDER_FINGERPRINT: self._cache[1][2]}

    def _position_mark(self) -> tuple:
        return self._epoch, self._origin, self._steps

    def _state_before(self, mark: tuple, count: int) -> dict:
        epoch, origin, steps = mark
        mine = [step for step, _ in rank_batches(self._steps_of_epoch(origin, key=(self._seed, epoch)), self.ctx.rank)
                if step <= steps]  # the steps after each of this rank's batches taken
        kept = len(mine) - count
        earlier = (epoch, origin, mine[kept - 1] if kept else 0)
        return self._raw_state(epoch, self._position_state(earlier))

    def _config(self) -> dict:
        return {
            "batch_sampler": type(self._user_sampler).__qualname__,
            "dataset_length": len(self._base.dataset),
            "batch_size": self._sampler_batch_size,
            "drop_last": self._drop_last,
            "even_batches": self._even_batches,
            "split_batches": self._split_batches,
        }

    def _rebatch_refusal(self, state_dict: Mapping[str, Any]) -> Optional[str]:
        saved, current = self._batch_change(state_dict)
        name = type(self._user_sampler).__name__
        return (
            f"the checkpoint was written with a {name} of batch_size={saved}, this run's has batch_size={current}; "
            f"your batch_sampler makes the batches and the saved position counts them, so the rest of the epoch "
            f"cannot be cut into other batches; resume with the same batch_sampler (batch_size={saved}), or pass "
            "DataLoader(batch_size=..., shuffle=...) without a batch_sampler, whose position counts samples and "
            "resumes at any batch size"
        )

    def _remainder(self) -> int:
        """Real samples in the epoch's last step when it is padded (what ``gather_for_metrics`` keeps), else -1."""
        steps = self._steps_of_epoch()
        if not steps or self._drop_last or not self._even_batches or self.ctx.world_size == 1:
            return -1
        before = steps[-2].consumed if len(steps) > 1 else self._origin
        real = sum(len(b) for b in self._epoch_batches()[before: steps[-1].consumed])
        dealt = sum(len(b) for b in steps[-1].batches if b is not None)
        return real if real < dealt else -1

    def _check_position(self, state_dict: Mapping[str, Any], source: str) -> None:
        where = f" in {source}" if source else ""
        saved = state_dict[S.TOPOLOGY]
        world, rank = saved.get("world_size"), saved.get("rank")
        numbers = (world, rank, state_dict.get(CONSUMED), state_dict.get(S.STRIPE_ORIGIN), state_dict.get(STEPS))
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in numbers) or rank >= world:
            raise UnsupportedConfigError(
                f"cannot resume{where}: invalid position or topology {numbers!r} (world_size, rank, {CONSUMED}, "
                f"{S.STRIPE_ORIGIN}, {STEPS}); the state is damaged or was edited by hand, resume from another "
                "checkpoint"
            )
        if world == self.ctx.world_size and rank != self.ctx.rank:
            raise UnsupportedConfigError(
                f"cannot resume{where}: the state belongs to rank {rank}, this is rank {self.ctx.rank}; "
                "load each rank's own state"
            )
        self._check_split(self.ctx.world_size, where)
        _, seed, _ = S.resolve_seed(state_dict, self._seed, self._seed_source)
        key = (seed, state_dict[S.EPOCH])
        self._check_order(state_dict, key, source)
        consumed, origin, steps = numbers[2:]
        try:
            dealt = self._steps_of_epoch(origin, world, key)
        except ValueError as exc:
            dealt, steps = [], f"{steps} ({exc})"
        fits = isinstance(steps, int) and steps <= len(dealt)
        if not fits or consumed != (dealt[steps - 1].consumed if steps else origin):
            raise UnsupportedConfigError(
                f"cannot resume{where}: {type(self._user_sampler).__name__} draws {len(self._epoch_batches(key))} "
                f"batches in epoch {key[1]}, which does not fit the saved position ({STEPS}={steps}, "
                f"{CONSUMED}={consumed}); the sampler must draw the same batches for the same seed and epoch "
                "(seed it from its generator or set_epoch), and the dataset must be the same"
            )

    def _check_order(self, state_dict: Mapping[str, Any], key: tuple[int, int], source: str) -> None:
        """Refuse a saved position whose epoch the sampler now draws in other batches (its seed changed)."""
        saved = state_dict.get(S.ORDER_FINGERPRINT)
        if saved is None:
            _refusals.legacy_order(self._user_sampler, (self._base.dataset,), LEGACY_PATHS, source)
            return
        self._epoch_batches(key)
        if self._cache[1][2] != saved:
            _refusals.order_changed(key[1], saved, self._cache[1][2], f"sampler:{type(self._user_sampler).__name__}",
                                    source)

    def merge_rank_states(self, states: list) -> Mapping[str, Any]:
        merged = super().merge_rank_states(states)
        found = {state.get(CONSUMED) for state in states if isinstance(state, Mapping)}
        if len(found) > 1:
            raise CheckpointError(
                f"cannot resume on another number of processes: the saved ranks disagree on how many of the "
                f"epoch's batches were taken ({sorted(found, key=str)}); the ranks were not in step when it was "
                "saved, resume it on the same number of processes"
            )
        return merged

    def _restore(self, state_dict: Mapping[str, Any]) -> None:
        if state_dict[S.TOPOLOGY]["world_size"] == self.ctx.world_size:
            self._origin, self._steps = state_dict[S.STRIPE_ORIGIN], state_dict[STEPS]
        else:
            # Elastic: the rest of the epoch, from the first batch nobody took, is dealt to the new ranks.
            self._origin, self._steps = state_dict[CONSUMED], 0

    def _rewind(self) -> None:
        self._origin, self._steps = 0, 0

    def _seek(self, num_batches: int) -> None:
        self._refuse_past_end(num_batches)
        own = rank_batches(self._steps_of_epoch(), self.ctx.rank)
        self._steps = own[num_batches - 1][0] if num_batches else 0

    def _epoch_start_batches(self, count: int) -> list:
        own = rank_batches(self._steps_of_epoch(origin=0), self.ctx.rank)[:count]
        return fetched_again(self._pipeline.mode, self._base.dataset, self._base.collate_fn, self._fetch_key(0),
                             own[0][0] if own else 0, [batch for _, batch in own], as_sampler=self._as_sampler)


def _sampler_seed(batch_sampler: Any, dataset: Any) -> tuple[int, str]:
    """The seed of the user's own generator, anywhere in the batch sampler (``_sampler_rng``), if it has one."""
    seed = user_seed(batch_sampler, (dataset,))
    return (seed, "generator") if seed is not None else (0, "none")
