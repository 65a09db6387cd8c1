"""The dispatcher: the main process reads global batches and hands each rank its slice."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
from accelerate.utils import concatenate, find_batch_size, slice_tensors
from torch.utils.data import DataLoader, IterableDataset

from ..checkpoint import _state as S
from ._adapter import DataLoaderAdapter
from ._broadcast import broadcast_step
from .._context import DistContext
from ..errors import UnsupportedConfigError
from ..position import _skips

FIRST = S.FIRST_SAMPLES
TAKEN = "samples_taken"  # samples of the epoch's order in the global batches the loop took, counted on every rank
# After a resume on another number of processes, where this epoch's steps of the new size began: the reader's
# batches taken then, and the steps counted for them. (0, 0) in an epoch started at this size.
ORIGIN = S.STEP_ORIGIN


class DispatchDataLoader(DataLoaderAdapter):
    """Reads on the main process only and sends each rank its part, exactly as Accelerate's dispatcher.

    Without ``split_batches`` a step concatenates ``world_size`` batches of the
    user's loader and rank ``r`` takes the ``r``-th part; with it, one batch is
    cut in ``world_size`` parts. A last step that does not divide evenly is
    completed with the epoch's first samples unless ``drop_last``. The position
    lives in one place: the *reader* (this package's loader for one process,
    over the user's dataset) on the main process, whose state is nested under
    ``base``. Its reads ahead are committed only when the step they belong to
    reaches the training loop, so a checkpoint records what the loop took.

    Without a process group (one process, or ranks simulated in a test) every
    rank runs the reader itself and takes its own slice, which yields the same
    batches.

    Examples:
        >>> accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(
        ...     use_stateful_dataloader=True, dispatch_batches=True))      # doctest: +SKIP
        >>> dl = accelerator.prepare(DataLoader(stream, batch_size=8))     # doctest: +SKIP
    """

    mode = S.DISPATCH_MODE

    def __init__(
        self,
        reader: DataLoaderAdapter,
        ctx: DistContext,
        *,
        split_batches: bool = False,
        drop_last: bool = False,
        slice_fn: Optional[Callable] = None,
        device: Optional[torch.device] = None,
        non_blocking: bool = False,
    ) -> None:
        if split_batches and (reader.batch_size is None or reader.batch_size % ctx.world_size != 0):
            raise UnsupportedConfigError(
                f"split_batches=True needs a batch_size divisible by the number of processes: "
                f"batch_size={reader.batch_size}, processes={ctx.world_size}; change one of them"
            )
        super().__init__(
            reader.unwrap(), ctx, seed=reader.seed, seed_source=reader.seed_source, device=device,
            non_blocking=non_blocking,
        )
        self._reader = reader
        self._split_batches = split_batches
        self._drop_last = drop_last
        self._slice_fn = slice_fn or slice_tensors
        self._steps = 0
        self._step_origin = (0, 0)
        self._first: Any = None
        self._samples = 0

    @classmethod
    def from_dataloader(
        cls,
        dataloader: DataLoader,
        ctx: Optional[DistContext] = None,
        *,
        device: Optional[torch.device] = None,
        non_blocking: bool = False,
        split_batches: bool = False,
        data_seed: Optional[int] = None,
        slice_fn: Optional[Callable] = None,
        pipeline_rng: str = "auto",
    ) -> "DispatchDataLoader":
        """Build the dispatcher that replaces a user's ``DataLoader`` in ``prepare``."""
        from .batchsampler import BatchSamplerDataLoader, uses_batch_sampler
        from .iterable import IterableShardDataLoader
        from ..sources.roundrobin import RoundRobinDataset, RoundRobinLoader
        from .shard import ShardDataLoader

        ctx = ctx if ctx is not None else DistContext.detect()
        alone = DistContext(0, 1)
        if isinstance(dataloader.dataset, RoundRobinDataset):
            reader = RoundRobinLoader.from_dataloader(dataloader, alone, data_seed=data_seed)
        elif isinstance(dataloader.dataset, IterableDataset):
            # It reads the next step before the loop takes this one.
            reader = IterableShardDataLoader.from_dataloader(dataloader, alone, data_seed=data_seed,
                                                             read_ahead=_step_batches(split_batches, ctx))
        elif uses_batch_sampler(dataloader):
            reader = BatchSamplerDataLoader.from_dataloader(dataloader, alone, data_seed=data_seed,
                                                            pipeline_rng=pipeline_rng)
        else:
            reader = ShardDataLoader.from_dataloader(dataloader, alone, data_seed=data_seed, pipeline_rng=pipeline_rng)
        if ctx.world_size > 1:  # only the main process reads: its seed is the one every rank records
            reader._seed = ctx.broadcast(reader.seed)
        return cls(
            reader, ctx, split_batches=split_batches, drop_last=dataloader.drop_last, slice_fn=slice_fn,
            device=device, non_blocking=non_blocking,
        )

    # ----------------------------------------------------------------- forwarded by name
    @property
    def dataset(self) -> Any:
        return self._reader.dataset

    @property
    def batch_size(self) -> int:
        return self._reader.batch_size // self.ctx.world_size if self._split_batches else self._reader.batch_size

    @property
    def total_batch_size(self) -> int:
        return self._reader.batch_size if self._split_batches else self._reader.batch_size * self.ctx.world_size

    @property
    def drop_last(self) -> bool:
        return self._drop_last

    @property
    def reader(self) -> DataLoaderAdapter:
        """The loader that reads the data on the main process."""
        return self._reader

    def __len__(self) -> int:
        read, steps = self._step_origin
        return steps + self._steps_for(len(self._reader) - read)

    @property
    def _group(self) -> int:
        return _step_batches(self._split_batches, self.ctx)

    def _steps_for(self, reader_batches: int) -> int:
        return reader_batches // self._group if self._drop_last else -(-reader_batches // self._group)

    # ----------------------------------------------------------------- position hooks
    @property
    def _reads(self) -> bool:
        return self.ctx.is_main or not self.ctx.is_collective

    def _batches(self) -> Iterator[Any]:
        group = self._group
        source = self._reader._open_pass() if self._reads else None
        current = self._step_from(source, group)
        while current is not None:
            upcoming = self._step_from(source, group)
            tokens, batch = current
            last = upcoming is None
            if self._samples is not None:  # (every rank holds the global batch, before its padding)
                self._samples += find_batch_size(batch)
            part = self._part(batch, last)
            for token in tokens:
                self._reader._commit(token)
            self._steps += 1
            self.end_of_dataloader = last
            yield part
            current = upcoming

    def _step_from(self, source: Optional[Iterator], group: int) -> Optional[tuple[list, Any]]:
        """The next global batch (and the reader tokens it consumes), agreed on by every rank."""
        def read() -> Optional[tuple[list, Any]]:
            taken = [pair for _, pair in zip(range(group), source)]
            if len(taken) == group or (taken and not self._drop_last):
                return [token for token, _ in taken], concatenate([batch for _, batch in taken], dim=0)
            return None

        return self._agreed(read if source is not None else None)

    def _agreed(self, read: Optional[Callable[[], Optional[tuple[list, Any]]]]) -> Optional[tuple[list, Any]]:
        """What ``read`` gives on the main process (``None``: this rank does not read), sent to every rank."""
        found, failure = None, None
        try:
            if read is not None:
                found = read()
        except Exception as exc:  # sent to every rank below, where it is raised as this rank raises it
            if not self.ctx.is_collective:
                raise
            failure = exc
        if not self.ctx.is_collective:
            return found
        return broadcast_step(found, failure, self.ctx, self.device)

    def _epoch_first(self) -> Any:
        """The epoch's first step, fetched again by the reader on the main process and sent to every rank: the
        padding of a last step where this pass did not begin at the epoch's start and no checkpoint gave it (a
        loader moved by ``seek``). Every rank asks at the same step, the one whose batch needs it."""
        def read() -> tuple[list, Any]:
            return [], concatenate(self._reader._epoch_start_batches(self._group), dim=0)

        return self._agreed(read if self._reads else None)[1]

    def _part(self, batch: Any, last: bool) -> Any:
        """This rank's slice of a global batch, completed with the epoch's first samples at the end."""
        world, rank = self.ctx.world_size, self.ctx.rank
        observed = find_batch_size(batch)
        per_rank = observed // world
        if not self._drop_last and self._first is None and self._steps == 0:  # the epoch's first step
            self._first = self._slice_fn(batch, slice(0, world), process_index=rank, num_processes=world)
        if last:
            self.remainder = observed
            if not self._drop_last and observed % world != 0:
                if self._first is None:
                    self._first = self._slice_fn(self._epoch_first(), slice(0, world), process_index=rank,
                                                 num_processes=world)
                first = self._first
                while find_batch_size(first) < world:  # saved on fewer processes: repeat it
                    first = concatenate([first, first], dim=0)
                batch = concatenate([batch, first], dim=0)
                per_rank += 1
        part = self._slice_fn(batch, slice(rank * per_rank, (rank + 1) * per_rank), process_index=rank,
                              num_processes=world)
        return self._place(part)

    def _batches_taken(self) -> int:
        return self._steps

    def _epoch_complete_at_restore(self) -> bool:
        try:
            total = len(self)
        except TypeError:  # a stream: only reading finds its end
            return False
        return total > 0 and self._steps >= total

    def _release_workers(self) -> None:
        super()._release_workers()
        self._reader._release_workers()

    def _end(self) -> None:
        super()._end()
        self._reader._live_base = None  # the reader's pass is this pass: its workers end with it, not at the next

    def _position_state(self) -> dict:
        return {S.BATCHES_YIELDED: self._steps, FIRST: self._first, ORIGIN: list(self._step_origin),
                TAKEN: self._samples, S.SKIPPED: [list(r) for r in self._left_out()]}

    def _base_state(self) -> Any:
        return self._reader.state_dict() if self._reads else None

    def _config(self) -> dict:
        reader = self._reader._config()
        return {**reader, "split_batches": self._split_batches, "drop_last": self._drop_last}

    def _remainder(self) -> int:
        try:
            return len(self.dataset) % self.total_batch_size
        except TypeError:
            return -1

    def _rebatch_refusal(self, state_dict: Mapping[str, Any]) -> Optional[str]:
        base = state_dict.get(S.BASE)
        if not isinstance(base, Mapping) or not isinstance(base.get(S.CONFIG), Mapping):
            saved, current = self._batch_change(state_dict)
            return (
                f"this run has batch_size={current} (was {saved}), and the dispatcher cuts the rest of the epoch "
                "again from the main process's reader state, which this process's state lacks; "
                "accelerator.load_state()/resume() hands it to every process; elsewhere (torch.distributed."
                f"checkpoint) resume with batch_size={saved}"
            )
        return self._reader._rebatch_refusal(base) if self._reader._batch_change(base) else None

    def needs_all_ranks(self, state_dict: Mapping[str, Any]) -> bool:
        # Another batch size, or an epoch re-cut or shortened before: every rank plans the reader's rest of the
        # epoch (its length) from the main process's reader state. A function of the main process's state, which
        # every rank then holds.
        base = state_dict.get(S.BASE)
        replanned = isinstance(base, Mapping) and bool(base.get(S.STRIPE_ORIGIN) or (
            base.get(S.SKIPPED) and self._reader.mode != S.STREAM_MODE))  # a stream's length does not change
        return super().needs_all_ranks(state_dict) or self._batch_change(state_dict) is not None or replanned

    def _check_position(self, state_dict: Mapping[str, Any], source: str) -> None:
        where = f" in {source}" if source else ""
        saved = state_dict[S.TOPOLOGY]
        merged = self.needs_all_ranks(state_dict)  # every rank was given the main process's state
        if saved.get("world_size") == self.ctx.world_size and saved.get("rank") != self.ctx.rank and not merged:
            raise UnsupportedConfigError(
                f"cannot resume{where}: the state belongs to rank {saved.get('rank')}, this is rank "
                f"{self.ctx.rank}; load each rank's own state"
            )
        if self._split_batches and state_dict[S.CONFIG].get("batch_size", 0) % saved.get("world_size", 1) != 0:
            raise UnsupportedConfigError(
                f"cannot resume{where}: invalid topology {saved!r}; the state is damaged, resume from another "
                "checkpoint"
            )
        base = state_dict.get(S.BASE)
        if self._reads or merged:
            if not isinstance(base, Mapping):
                raise UnsupportedConfigError(
                    f"cannot resume{where}: the main process's state has no reader state under '{S.BASE}'; "
                    "the file is damaged or belongs to another rank, resume from another checkpoint"
                )
            self._reader.validate_state(base, source)

    def _restore(self, state_dict: Mapping[str, Any]) -> None:
        rebatched = self._batch_change(state_dict) is not None
        base = state_dict[S.BASE]
        if self._reads or self.needs_all_ranks(state_dict):  # (every rank's reader then plans the same rest)
            self._reader.load_state_dict(base)
        elif hasattr(self._reader, "_skips"):  # its length, with the epoch's samples left out
            saved = _skips.check_saved(state_dict.get(S.SKIPPED, []), "")
            added = [r for r in self._reader._skips if r not in saved]  # given before the load, on every process
            self._reader._skips = _skips.merged(saved + added)
            self._reader._start_epoch(state_dict[S.EPOCH])
        self._steps = state_dict[S.BATCHES_YIELDED]
        self._step_origin = tuple(state_dict.get(ORIGIN) or (0, 0))
        self._samples = state_dict.get(TAKEN)  # None in a state of an earlier release: skip_samples is refused
        if rebatched:
            # The reader re-cut the rest of its epoch into batches of the new size; what was taken counts in
            # steps of the new size, and the rest is cut in steps of the new size from there.
            self._steps = -(-base.get(S.SAMPLES_CONSUMED, 0) // self.total_batch_size)
            self._step_origin = (self._reader._batches_taken(), self._steps)
        elif state_dict[S.TOPOLOGY]["world_size"] != self.ctx.world_size:
            # Elastic: the reader's position is unchanged; what was taken counts in steps of the new size, and
            # the rest of the epoch is cut in steps of the new size from there (so len() counts both).
            read = base[S.BATCHES_YIELDED]
            self._steps = -(-read // self._group)
            self._step_origin = (read, self._steps)
        self._first = state_dict.get(FIRST)

    def _rewind(self) -> None:
        self._steps = 0
        self._step_origin = (0, 0)
        self._first = None
        self._samples = 0
        self._reader._start_epoch(self._epoch)

    def skip_samples(self, start: int, stop: int, epoch: Optional[int] = None) -> None:
        """Leave out positions ``start`` to ``stop - 1`` of an epoch's order, for good
        (``ShardDataLoader.skip_samples``: the reader's order is the global one), or those item indices of a
        composable source (``IterableShardDataLoader.skip_samples``)."""
        self._refuse_if_live("skip_samples()")
        reader = self._reader
        if reader.mode == S.STREAM_MODE:  # a composable source's item indices, or refused with the reason
            reader._add_skip(self._epoch if epoch is None else epoch, start, stop, current_epoch=self._epoch)
            return
        if not hasattr(reader, "_skips"):
            reader.skip_samples(start, stop, epoch)  # refused, with the reason
        if self._samples is None:
            raise UnsupportedConfigError(
                "skip_samples() cannot place this dispatcher's position: it was resumed from a checkpoint written by "
                "an earlier release, which did not record the samples taken on every process; save a checkpoint "
                "with this release (at the next one) and call skip_samples after resuming from it"
            )
        reader._add_skip(self._epoch if epoch is None else epoch, start, stop, consumed=self._samples,
                         current_epoch=self._epoch)

    def _left_out(self) -> Sequence[Sequence[int]]:
        return self._reader._left_out()

    def _seek(self, num_batches: int) -> None:
        if self._reader.mode in (S.STREAM_MODE, S.ROUND_ROBIN_MODE):
            self._reader._seek(num_batches)  # refused, with the reason: a stream cannot be moved without reading it
        self._refuse_past_end(num_batches)
        read, steps = self._step_origin
        if num_batches < steps:
            # Before the steps of this size began: counted as if the whole epoch had run at this size.
            read, steps = self._step_origin = (0, 0)
        target = min(read + (num_batches - steps) * self._group, len(self._reader))
        if self._reads:
            self._reader.seek(target)
        plan = getattr(self._reader, "_plan", None)  # (map-style: the samples those steps take, on every rank)
        self._samples = plan.samples_consumed(target) if plan is not None else None
        self._steps = num_batches


def _step_batches(split_batches: bool, ctx: DistContext) -> int:
    """The reader's batches one step takes: one cut in ``world_size`` parts, or one per process."""
    return 1 if split_batches else ctx.world_size
