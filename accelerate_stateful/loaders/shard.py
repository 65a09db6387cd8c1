"""The shard loader: each rank reads its own share of a map-style dataset."""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator, Mapping, Optional, Sized

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from .. import _log
from ..checkpoint import _state as S
from ._adapter import DataLoaderAdapter
from .._context import DistContext
from ..position._distributed import DistributedOrder, owns_sharding, share_length
from ..position._order import SHUFFLES, EpochOrder, SamplerOrder, choose_seed, mix_seed, order_for
from ..position._sampler_rng import fingerprint
from ._ordered import require_in_order
from ..training._rng import PipelineRNG
from ._refetch import fetched_again
from ..position import _skips
from ..position._plan import ShardPlan
from ..checkpoint import _refusals
from ..position._saved import check_saved_steps, check_saved_topology, shard_plan
from ..errors import UnsupportedConfigError

logger = _log.get_logger(__name__)

# DataLoader settings carried from the user's loader to the base loader, by name.
LOADER_SETTINGS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)

_WORKER_SALT = 0x5EED
_CHUNK_SAMPLES = 2048  # indices a pass turns into Python ints at once (whole batches; at least one)


class _PlanBatchSampler(Sampler[list[int]]):
    """Feeds the base loader the index lists of one pass, from a start step on."""

    def __init__(self) -> None:
        self._indices = torch.empty(0, dtype=torch.int64)
        self._plan: Optional[ShardPlan] = None
        self._start = 0
        self._tag: Optional[Callable[[int, list], list]] = None

    def set_pass(self, indices: torch.Tensor, plan: ShardPlan, start: int,
                 tag: Optional[Callable[[int, list], list]]) -> None:
        """``tag(step, indices)`` is what the base loader receives for batch ``step`` (see ``_rng``); ``None``: the
        indices as they are."""
        self._indices, self._plan, self._start, self._tag = indices, plan, start, tag

    def __iter__(self) -> Iterator[list[int]]:
        indices, plan, tag = self._indices, self._plan, self._tag
        size, stride = plan.batch_size, plan.total_batch_size
        step, end = self._start, plan.num_batches
        while step < end:
            # Whole, evenly spaced batches are turned into lists a chunk at a time (one strided view): a tensor
            # slice per batch would cost more than the rest of the batch's bookkeeping.
            run = min(plan.strided_run(step), max(1, _CHUNK_SAMPLES // size))
            start, stop = plan.batch_span(step)
            if run:
                batches = indices[start:start + (run - 1) * stride + size].unfold(0, size, stride).tolist()
            else:  # a last batch cut short, or completed by wrapping around to the epoch's start
                batches = [indices[torch.arange(start, stop) % plan.num_samples].tolist()]
            for batch in batches:
                yield batch if tag is None else tag(step, batch)
                step += 1

    def __len__(self) -> int:
        return self._plan.num_batches - self._start if self._plan is not None else 0


class ShardDataLoader(DataLoaderAdapter):
    """Each rank reads its own batches of a map-style dataset, exactly as Accelerate shards it.

    The epoch's order is a pure function of (seed, epoch); the position is the
    number of samples all ranks together consumed in the epoch, from which this
    rank's next batch is computed: resuming reads no sample it does not deliver,
    and workers hold no position, so ``num_workers`` may change between runs.

    Examples:
        >>> dl = DataLoader(range(10), batch_size=2, shuffle=True)
        >>> shard = ShardDataLoader.from_dataloader(dl, DistContext(rank=0, world_size=2))
        >>> len(shard)
        3
    """

    mode = S.SHARD_MODE

    def __init__(
        self,
        dataset: Any,
        *,
        order: EpochOrder,
        batch_size: int,
        ctx: DistContext,
        seed: int,
        seed_source: str,
        drop_last: bool = False,
        even_batches: bool = True,
        split_batches: bool = False,
        device: Optional[torch.device] = None,
        non_blocking: bool = False,
        pipeline_rng: str = "auto",
        **loader_settings: Any,
    ) -> None:
        if split_batches and batch_size % ctx.world_size != 0:
            raise UnsupportedConfigError(
                f"split_batches=True needs a batch_size divisible by the number of processes: "
                f"batch_size={batch_size}, processes={ctx.world_size}; change one of them"
            )
        require_in_order(loader_settings)
        self._sampler = _PlanBatchSampler()
        self._worker_generator = torch.Generator()
        base = DataLoader(dataset, batch_sampler=self._sampler, generator=self._worker_generator, **loader_settings)
        super().__init__(base, ctx, seed=seed, seed_source=seed_source, device=device, non_blocking=non_blocking)
        self._loader_batch_size = batch_size
        self._drop_last = drop_last
        self._even_batches = even_batches
        self._split_batches = split_batches
        if getattr(order, "sampler", None) is not None and owns_sharding(order.sampler, ctx.world_size, ctx.rank):
            order = DistributedOrder(order.sampler, self._plan_at, ctx.world_size)
        self._base_order = self._order = order
        self._skips: list[list[int]] = []  # [epoch, start, stop] ranges of positions left out (``skip_samples``)
        self._plan = self._plan_from(0)
        self._consumed = 0
        self._cached_order: tuple[tuple, torch.Tensor, list] = ((-1, -1, -1), torch.empty(0), [])
        self._pipeline = PipelineRNG(pipeline_rng, self.num_workers, dataset)
        # The first epoch's order is drawn here (``prepare``, which every process reaches): a sampler that cannot
        # be resumed is refused on every process at the same point, never at a first len(dl) one process makes.
        self._epoch_indices()

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
        use_seedable_sampler: bool = False,
    ) -> "ShardDataLoader":
        """Build the shard loader that replaces a user's ``DataLoader`` in ``prepare``."""
        ctx = ctx if ctx is not None else DistContext.detect()
        dataset = dataloader.dataset
        if isinstance(dataset, IterableDataset):
            raise UnsupportedConfigError(
                f"{type(dataset).__name__} is an IterableDataset, which the stateful shard loader does not "
                "support yet; use a map-style dataset or set use_stateful_dataloader=False"
            )
        if dataloader.batch_size is None:
            raise UnsupportedConfigError(
                "the DataLoader has no batch_size, which the shard loader does not support; pass batch_size=..., "
                "or, for your own batches, batch_sampler=... (prepared as BatchSamplerDataLoader)"
            )
        sampler = dataloader.sampler
        if not isinstance(sampler, Sized):
            raise UnsupportedConfigError(
                f"the sampler {type(sampler).__name__} has no len(), so a position in its epoch cannot be "
                "resumed; give it a __len__ or use a sampler that has one"
            )
        seed, seed_source = choose_seed(dataloader, data_seed, ctx, use_seedable_sampler)
        settings = loader_settings(dataloader)
        return cls(
            dataset,
            order=order_for(sampler, dataset, use_seedable_sampler),
            batch_size=dataloader.batch_size,
            ctx=ctx,
            seed=seed,
            seed_source=seed_source,
            drop_last=dataloader.drop_last,
            even_batches=even_batches,
            split_batches=split_batches,
            device=device,
            non_blocking=non_blocking,
            pipeline_rng=pipeline_rng,
            **settings,
        )

    # ----------------------------------------------------------------- forwarded by name
    @property
    def batch_size(self) -> int:
        """Samples per batch on this rank."""
        return self._plan.batch_size

    @property
    def total_batch_size(self) -> int:
        """Samples per step across all ranks (Accelerate's name)."""
        return self._plan.total_batch_size

    @property
    def total_dataset_length(self) -> int:
        return self._order.num_samples

    @property
    def drop_last(self) -> bool:
        return self._drop_last

    @property
    def batch_sampler(self) -> Sampler:
        return self._sampler

    def __len__(self) -> int:
        return self._plan.num_batches

    # ----------------------------------------------------------------- position hooks
    def _plan_from(
        self, origin: int, world: Optional[int] = None, rank: Optional[int] = None, order: Optional[EpochOrder] = None,
        batch_size: Optional[int] = None, skipped: Optional[int] = None,
    ) -> ShardPlan:
        """This epoch's plan from ``origin``, for this rank (or for another topology, to check a saved state),
        over the epoch's order without the ``skipped`` positions left out (by default, this epoch's)."""
        world = self.ctx.world_size if world is None else world
        rank = self.ctx.rank if rank is None else rank
        skipped = _skips.count(self._skips, self._epoch) if skipped is None else skipped
        return self._plan_at(world, rank, (order or self._order).num_samples - skipped, origin, batch_size)

    def _plan_at(self, world: int, rank: int, num_samples: int, origin: int = 0,
                 batch_size: Optional[int] = None) -> ShardPlan:
        """How an order of ``num_samples`` is striped on ``world`` processes (the user's batch settings, or a saved
        ``batch_size``)."""
        batch_size = self._loader_batch_size if batch_size is None else batch_size
        settings = {"batch_size": batch_size, "num_samples": num_samples, "drop_last": self._drop_last,
                    "even_batches": self._even_batches, "split_batches": self._split_batches}
        return shard_plan(settings, world, rank, origin)

    def _epoch_indices(self, seed: Optional[int] = None, epoch: Optional[int] = None,
                       order: Optional[EpochOrder] = None) -> torch.Tensor:
        """The order of ``epoch`` drawn from ``seed`` (the current ones by default), memoised."""
        order = order or self._order
        key = (self._seed if seed is None else seed, self._epoch if epoch is None else epoch,
               getattr(order, "world_size", 0), getattr(order, "order_batch", None), order.kind)
        if self._cached_order[0] != key:
            indices = order.indices(*key[:2])
            if len(indices) != order.num_samples:
                raise UnsupportedConfigError(
                    f"the sampler ({order.kind}) drew {len(indices)} indices in epoch {key[1]}, but "
                    f"its len() is {order.num_samples}; a resumable sampler must draw len() indices"
                )
            self._cached_order = (key, indices, [])
        return self._cached_order[1]

    def _fingerprint(self, seed: Optional[int] = None, epoch: Optional[int] = None,
                     order: Optional[EpochOrder] = None) -> str:
        """A digest of the epoch's order (``_sampler_rng.fingerprint``), memoised with it."""
        known = getattr(order or self._order, "known_fingerprint", None)  # an order the command line cannot draw
        if known is not None and known(seed, epoch) is not None:
            return known(seed, epoch)
        self._epoch_indices(seed, epoch, order)
        memo = self._cached_order[2]
        if not memo:
            memo.append(fingerprint(self._cached_order[1]))
        return memo[0]

    def _pass_indices(self) -> torch.Tensor:
        """The epoch's order as this epoch is read: without the positions ``skip_samples`` left out."""
        return _skips.kept(self._epoch_indices(), self._skips, self._epoch)

    def _use_order_of(self, world: int) -> None:
        """Read the epoch in the order it has on ``world`` processes (a ``DistributedSampler``'s depends on it)."""
        self._order = self._base_order.at_world(world)

    def _batches(self) -> Iterator[Any]:
        plan = self._plan  # the pass's: the position moves to another plan only after its last batch
        total = plan.num_batches
        place = None if self.device is None else self._place
        step, batches = self._start_pass(read_ahead=False)
        for batch in batches:
            step += 1
            self._consumed = plan.samples_consumed(step)  # ``_commit(step)``, a call less per batch
            self.end_of_dataloader = step == total
            yield batch if place is None else place(batch)

    def _open_pass(self, read_ahead: bool = True) -> Iterator[tuple[int, Any]]:
        step, batches = self._start_pass(read_ahead)
        for batch in batches:
            step += 1
            yield step, batch

    def _start_pass(self, read_ahead: bool) -> tuple[int, Iterator[Any]]:
        """``(batches already taken, the base loader's batches from there)`` for a pass from the current position."""
        plan = self._plan
        step = plan.steps_for(self._consumed)
        where = self._fetch_key(plan.origin)
        pipeline = self._pipeline
        self._sampler.set_pass(self._pass_indices(), plan, step, pipeline.tagger(where))
        self._worker_generator.manual_seed(mix_seed(self._seed, self._epoch, _WORKER_SALT))
        return step, pipeline.fetch(self._open_base(), where, step, read_ahead)

    def _commit(self, token: int) -> None:
        self._consumed = self._plan.samples_consumed(token)

    def _batches_taken(self) -> int:
        return self._plan.steps_for(self._consumed)

    def _epoch_complete(self) -> bool:
        """This rank's last batch was handed out and every rank took every batch (the busiest rank's last step)."""
        return self.end_of_dataloader and self._epoch_complete_at_restore()

    def _epoch_complete_at_restore(self) -> bool:
        plan = self._plan
        return plan.num_steps > 0 and self._consumed >= plan.samples_consumed(plan.num_steps)

    def _progress(self) -> Optional[float]:
        """Samples of the epoch taken by all ranks together (after an elastic resume too), from 0 to 1."""
        return self._consumed / self._plan.num_samples if self._plan.num_samples else None

    def _position_state(self, mark: Optional[tuple] = None) -> dict:
        epoch, order, plan, consumed = self._position_mark() if mark is None else mark
        state = {
            S.SAMPLES_CONSUMED: consumed,
            S.STRIPE_ORIGIN: plan.origin,
            S.BATCHES_YIELDED: plan.steps_for(consumed),
            S.ORDER_FINGERPRINT: self._fingerprint(epoch=epoch, order=order),
            S.SKIPPED: [list(r) for r in self._skips],
        }
        if order.world_dependent:
            state[S.ORDER_WORLD] = order.world_size
            if getattr(order, "order_batch", self._loader_batch_size) != self._loader_batch_size:
                state[S.ORDER_BATCH] = order.order_batch  # the epoch began at another batch size
        return state

    def _position_mark(self) -> tuple:
        return self._epoch, self._order, self._plan, self._consumed

    def _state_before(self, mark: tuple, count: int) -> dict:
        epoch, order, plan, consumed = mark
        earlier = (epoch, order, plan, plan.samples_consumed(plan.steps_for(consumed) - count))
        return self._raw_state(epoch, self._position_state(earlier))

    def _config(self) -> dict:
        return {
            "batch_size": self._loader_batch_size,
            "dataset_length": len(self._base.dataset),
            "num_samples": self._base_order.config_length,
            "drop_last": self._drop_last,
            "even_batches": self._even_batches,
            "split_batches": self._split_batches,
            "order": self._order.kind,
        }

    def _config_at(self, world: int) -> dict:
        config = self._config()
        if self._base_order.world_dependent:
            config["num_samples"] = share_length(self._base_order.sampler, world)
        return config

    def _rebatch_refusal(self, state_dict: Mapping[str, Any]) -> Optional[str]:
        return None  # the position counts samples: the rest of the epoch is cut at the new size (``_restore``)

    def _remainder(self) -> int:
        plan = self._plan
        if self._drop_last:
            return -1
        # Real samples in the last step: those before the order's own padding (a DistributedSampler's).
        last = plan.origin + max(plan.num_steps - 1, 0) * plan.total_batch_size
        return min(max(plan.num_samples - self._order.padding - last, 0), plan.total_batch_size) % \
            plan.total_batch_size

    def _check_position(self, state_dict: Mapping[str, Any], source: str) -> None:
        saved_batch = state_dict[S.CONFIG]["batch_size"]  # may differ from this run's: the position is in samples
        settings = {"batch_size": saved_batch, "split_batches": self._split_batches}
        world, rank = check_saved_topology(settings, state_dict, self.ctx.world_size, self.ctx.rank, source)
        order = self._saved_order(state_dict, f" in {source}" if source else "")
        self._check_order(state_dict, order, source)
        origin = state_dict.get(S.STRIPE_ORIGIN, 0)
        skipped = _skips.count(self._skips_after_load(state_dict, source), state_dict[S.EPOCH])
        check_saved_steps(lambda: self._plan_from(origin, world, rank, order, saved_batch, skipped),
                          self._saved_consumed(state_dict, order), state_dict, source)

    def _config_for(self, state_dict: Mapping[str, Any]) -> dict:
        config = super()._config_for(state_dict)
        config["order"] = self._kept_shuffle(state_dict).kind
        return config

    def _kept_shuffle(self, state_dict: Mapping[str, Any]) -> EpochOrder:
        """A plain shuffle keeps the order its checkpoint was written in (``_order.SHUFFLES``: both are pure
        functions of seed and epoch), whichever ``use_seedable_sampler`` this run has."""
        saved = state_dict[S.CONFIG].get("order")
        if self._base_order.kind in SHUFFLES and saved in SHUFFLES and saved != self._base_order.kind:
            return SHUFFLES[saved](self._base_order.num_samples)
        return self._base_order

    def _saved_order(self, state_dict: Mapping[str, Any], where: str) -> EpochOrder:
        """The order the saved epoch is read in: a ``DistributedSampler``'s keeps the world size that began it."""
        if not self._base_order.world_dependent:
            return self._kept_shuffle(state_dict)
        world = state_dict.get(S.ORDER_WORLD, state_dict[S.TOPOLOGY]["world_size"])
        batch = state_dict.get(S.ORDER_BATCH, state_dict[S.CONFIG]["batch_size"])
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (world, batch)):
            raise UnsupportedConfigError(
                f"cannot resume{where}: invalid number of processes {world!r} or batch size {batch!r} of the epoch's "
                "order; the state is damaged or was edited by hand, resume from another checkpoint"
            )
        if batch == self._loader_batch_size:
            return self._base_order.at_world(world)
        # The epoch began at another batch size: its order is the steps of that size (their padding included).
        order = DistributedOrder(self._base_order.sampler, lambda w, r, n: self._plan_at(w, r, n, 0, batch), world)
        order.order_batch = batch
        return order

    def _saved_consumed(self, state_dict: Mapping[str, Any], order: EpochOrder) -> int:
        """The saved position in samples of ``order``. A ``DistributedSampler``'s position saved by an earlier
        release counted the samples of one process's share: converted through the steps it stands for."""
        consumed = state_dict[S.SAMPLES_CONSUMED]
        if not order.world_dependent or S.ORDER_WORLD in state_dict:
            return consumed
        world, batch = state_dict[S.TOPOLOGY]["world_size"], state_dict[S.CONFIG]["batch_size"]
        steps = self._plan_at(world, 0, order.config_length, 0, batch).steps_for(consumed)  # rank 0: every step
        return self._plan_at(world, 0, order.num_samples, 0, batch).samples_consumed(steps)

    def _check_order(self, state_dict: Mapping[str, Any], order: EpochOrder, source: str) -> None:
        """Refuse a saved position whose epoch this run draws in another order than the run that saved it."""
        saved = state_dict.get(S.ORDER_FINGERPRINT)
        if saved is None:
            if isinstance(self._base_order, SamplerOrder):
                _refusals.legacy_order(self._base_order.sampler, self._base_order.skip, (".generator",), source)
            return
        _, seed, _ = S.resolve_seed(state_dict, self._seed, self._seed_source)
        current = self._fingerprint(seed, state_dict[S.EPOCH], order)
        if current != saved:
            _refusals.order_changed(state_dict[S.EPOCH], saved, current, self._order.kind, source)

    def _restore(self, state_dict: Mapping[str, Any]) -> None:
        self._base_order = self._kept_shuffle(state_dict)
        self._order = self._saved_order(state_dict, "")
        if state_dict[S.SAMPLES_CONSUMED] == 0:
            self._use_order_of(self.ctx.world_size)  # an epoch nobody began yet is this world size's own
        consumed = self._saved_consumed(state_dict, self._order)
        if not self._relaid(state_dict):
            origin = state_dict.get(S.STRIPE_ORIGIN, 0)
        else:
            # Another world size or batch size: the rest of the epoch, from the first sample nobody took, is
            # striped over the ranks in steps of the new size.
            origin = consumed
        self._skips = self._skips_after_load(state_dict, "")
        self._plan = self._plan_from(origin, skipped=_skips.count(self._skips, state_dict[S.EPOCH]))
        self._consumed = consumed

    def _skips_after_load(self, state_dict: Mapping[str, Any], source: str) -> list[list[int]]:
        """The saved ranges left out, with those this loader was given before the load (``skip_samples`` called
        before ``resume()``), which must lie at or after the saved position."""
        saved = _skips.check_saved(state_dict.get(S.SKIPPED, []), f" in {source}" if source else "")
        added = [r for r in self._skips if r not in saved]
        epoch = state_dict[S.EPOCH]
        for r in added:
            _skips.check_new(saved, r[0], r[1], r[2], current_epoch=epoch, consumed=state_dict[S.SAMPLES_CONSUMED],
                             length=self._order.num_samples)
        return _skips.merged(saved + added)

    def skip_samples(self, start: int, stop: int, epoch: Optional[int] = None) -> None:
        """Leave out positions ``start`` to ``stop - 1`` of an epoch's order (a loss spike's batches), for good.

        Positions count the epoch's order as ``samples_consumed`` does, the same on any number of processes,
        workers or batch size: on one setup, step ``k`` of the epoch holds ``k * total_batch_size`` to
        ``(k + 1) * total_batch_size``. The ranges are saved with the position, so every later resume (on any
        setup) leaves them out too. Call it on every process alike, between passes.

        Args:
            start: The first position left out.
            stop: The position after the last one left out.
            epoch: The epoch whose order it is; ``None``: the epoch the loader's position is in (after
                ``resume()``, the epoch the next batch comes from).

        Raises:
            UnsupportedConfigError: for a range outside the epoch, in a past epoch, or reaching back to samples the
                loader already took.

        Examples:
            >>> accelerator.resume()                                 # doctest: +SKIP
            >>> train_dl.skip_samples(4096, 4608)                    # doctest: +SKIP
        """
        self._refuse_if_live("skip_samples()")
        self._add_skip(self._epoch if epoch is None else epoch, start, stop, consumed=self._consumed,
                       current_epoch=self._epoch)

    def _add_skip(self, epoch: int, start: int, stop: int, *, consumed: int, current_epoch: int) -> None:
        """Record a range left out, checked against the position ``consumed`` of ``current_epoch`` (this loader's,
        or the dispatcher's when this loader is its reader), and re-plan the epoch it falls in."""
        _skips.check_new(self._skips, epoch, start, stop, current_epoch=current_epoch, consumed=consumed,
                         length=self._order.num_samples)
        self._skips = _skips.merged(self._skips + [[epoch, start, stop]])
        if epoch == self._epoch:
            self._plan = self._plan_from(self._plan.origin)

    def _left_out(self) -> list[list[int]]:
        return self._skips

    def _rewind(self) -> None:
        self._use_order_of(self.ctx.world_size)  # a new epoch is this world size's own
        self._plan = self._plan_from(0)
        self._consumed = 0

    def _seek(self, num_batches: int) -> None:
        self._refuse_past_end(num_batches)
        self._consumed = self._plan.samples_consumed(num_batches)

    def _epoch_start_batches(self, count: int) -> list:
        plan = self._plan_from(0)
        sampler = _PlanBatchSampler()
        sampler.set_pass(self._pass_indices(), plan, 0, None)
        batches = list(itertools.islice(sampler, count))
        return fetched_again(self._pipeline.mode, self._base.dataset, self._base.collate_fn,
                             self._fetch_key(plan.origin), 0, batches)


def loader_settings(dataloader: DataLoader) -> dict:
    """The user's ``DataLoader`` settings (``LOADER_SETTINGS``) a variant carries over to its base loader."""
    return {name: getattr(dataloader, name) for name in LOADER_SETTINGS if hasattr(dataloader, name)}
