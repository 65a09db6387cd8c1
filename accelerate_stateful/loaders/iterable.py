"""The iterable shard loader: each rank reads the stream of an ``IterableDataset`` itself."""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate

from .. import _log
from ..checkpoint import _state as S
from ._adapter import DataLoaderAdapter
from .._context import DistContext
from ..position._order import mix_seed
from ._ordered import require_in_order
from ._agree import agree_snapshots
from . import _frontier, _stream_skips
from ._channels import WorkerStart
from ._stream import Slicer, StreamDataset, passthrough
from ._shares import MARKER, deal, worker_base_seed
from ._reading import LOGICAL, SPLIT, WHOLE, Readers, check_rescale, check_shares, shown_workers
from ._workerinit import LogicalWorkerInit
from ..position import _skips
from ..sources._global import GlobalStream
from ..sources.sharded import LogicalShardStream, ShardedSource, merge_positions
from ..errors import UnsupportedConfigError

logger = _log.get_logger(__name__)

STREAM = S.STREAM
_WORKER_SALT = 0x5EED
_BASE_SETTINGS = ("pin_memory", "timeout", "worker_init_fn", "prefetch_factor", "persistent_workers",
                  "pin_memory_device")


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class StreamPosition:
    """What the training loop took from each logical worker in this epoch, and where each resumes.

    An epoch resumed from a run with another ``num_workers`` keeps that run's logical workers
    (``num_logical``, read as ``shown`` workers: see ``_shares``) until it ends; the next epoch starts
    with this loader's own.
    """

    def __init__(self, num_workers: int) -> None:
        self.own = (max(num_workers, 1), num_workers)
        self.reset()

    def reset(self) -> None:
        self.num_logical, self.shown = self.own
        self.before = 0  # batches the epoch took before its shares were dealt again (``_frontier``)
        # Each earlier dealing of the epoch: [its first batch, origin, block, world size] (``samples`` reads them).
        self.regrouped: list[list[int]] = []
        self.taken = [0] * self.num_logical
        self.snapshots: list[Optional[dict]] = [None] * self.num_logical  # where each logical worker starts
        self.rotation = 0
        self.last: Optional[int] = None

    @property
    def batches(self) -> int:
        return self.before + sum(self.taken)

    def next_rotation(self) -> int:
        return self.rotation if self.last is None else (self.last + 1) % self.num_logical


class IterableShardDataLoader(DataLoaderAdapter):
    """Each rank iterates an ``IterableDataset`` and keeps its share, exactly as Accelerate does.

    Without ``split_batches`` each rank takes its slice of every global batch of
    ``batch_size * world_size`` items (Accelerate's ``IterableDatasetShard``);
    the last one is completed from the epoch's first global batch unless
    ``drop_last``. A dataset that implements ``state_dict()``/``load_state_dict()``
    resumes exactly without reading anything it does not deliver; one that does
    not is fast-forwarded, with a warning and a count of replayed samples.

    Examples:
        >>> loader = IterableShardDataLoader.from_dataloader(DataLoader(stream, batch_size=8),
        ...                                                  DistContext(0, 2))   # doctest: +SKIP
    """

    mode = S.STREAM_MODE

    def __init__(
        self,
        dataset: IterableDataset,
        *,
        batch_size: int,
        ctx: DistContext,
        seed: int,
        seed_source: str,
        drop_last: bool = False,
        split_batches: bool = False,
        slice_per_rank: bool = True,
        num_workers: int = 0,
        collate_fn: Any = None,
        multiprocessing_context: Any = None,
        device: Optional[torch.device] = None,
        non_blocking: bool = False,
        read_ahead: int = 0,
        **loader_settings: Any,
    ) -> None:
        if split_batches and batch_size % ctx.world_size != 0:
            raise UnsupportedConfigError(
                f"split_batches=True needs a batch_size divisible by the number of processes: "
                f"batch_size={batch_size}, processes={ctx.world_size}; change one of them"
            )
        require_in_order(dict(loader_settings, num_workers=num_workers))
        loader_settings.pop("in_order", None)
        user_init = loader_settings.pop("worker_init_fn", None)
        self._per_rank = batch_size // ctx.world_size if split_batches else batch_size
        slicer = Slicer(ctx.world_size, ctx.rank, self._per_rank, drop_last) if slice_per_rank else None
        self._stream = StreamDataset(
            dataset,
            batch_size=self._per_rank,
            drop_last=drop_last,
            collate_fn=collate_fn or default_collate,
            num_workers=num_workers,
            # A worker keeps the states after its batches that a checkpoint may still ask for: those its
            # prefetch holds and those an owner reading ahead of the loop took (the dispatcher: one step).
            ring_size=(loader_settings.get("prefetch_factor") or 2) * max(num_workers, 1) + 4 + read_ahead,
            slicer=slicer,
            mp_context=multiprocessing_context,
            shown=dataset.source if isinstance(dataset, LogicalShardStream) else dataset,
            # called by the stream in each worker, once it knows which logical worker it plays
            worker_init=LogicalWorkerInit(user_init, bool(loader_settings.get("persistent_workers")))
            if user_init is not None else None,
        )
        self._worker_generator = torch.Generator()
        base = DataLoader(
            self._stream,
            batch_size=None,
            collate_fn=passthrough,
            num_workers=num_workers,
            multiprocessing_context=multiprocessing_context,
            generator=self._worker_generator,
            **loader_settings,
        )
        super().__init__(base, ctx, seed=seed, seed_source=seed_source, device=device, non_blocking=non_blocking)
        self._loader_batch_size = batch_size
        self._drop_last = drop_last
        self._split_batches = split_batches
        self._sliced = slicer is not None
        if isinstance(dataset, LogicalShardStream):
            self._reading = LOGICAL
        else:
            self._reading = WHOLE if self._sliced or ctx.world_size == 1 else SPLIT
        self._position = StreamPosition(num_workers)
        self._generation = 0
        self._pass: Optional[tuple[int, int, list[WorkerStart]]] = None
        self.replayed_samples = 0
        self._skips: list[list[int]] = []  # [epoch, start, stop] item indices left out (``skip_samples``)
        self._unannounced: list[list[int]] = []  # ranges given in this process, not yet set against the shares

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
        read_ahead: int = 0,
    ) -> "IterableShardDataLoader":
        """Build the loader that replaces a user's ``DataLoader`` over an ``IterableDataset``; ``read_ahead``:
        the batches its owner may read past the last one the training loop took (the dispatcher's next step)."""
        from ..position._order import choose_seed

        ctx = ctx if ctx is not None else DistContext.detect()
        if dataloader.batch_size is None:
            raise UnsupportedConfigError(
                "the DataLoader has batch_size=None; the stateful loader needs batch_size=... to batch the stream"
            )
        if isinstance(dataloader.dataset, ShardedSource):
            dataset, sliced = LogicalShardStream(dataloader.dataset, ctx.world_size, ctx.rank), False
        else:
            dataset, sliced = shard_hf_iterable(dataloader.dataset, ctx, split_batches)
            dataset = _exact_hf_stream(dataset)
        seed, seed_source = choose_seed(dataloader, data_seed, ctx)
        settings = {name: getattr(dataloader, name) for name in _BASE_SETTINGS if hasattr(dataloader, name)}
        return cls(
            dataset,
            batch_size=dataloader.batch_size,
            ctx=ctx,
            seed=seed,
            seed_source=seed_source,
            drop_last=dataloader.drop_last,
            split_batches=split_batches,
            slice_per_rank=sliced,
            num_workers=dataloader.num_workers,
            collate_fn=dataloader.collate_fn,
            multiprocessing_context=dataloader.multiprocessing_context,
            in_order=getattr(dataloader, "in_order", True),
            device=device,
            non_blocking=non_blocking,
            read_ahead=read_ahead,
            **settings,
        )

    # ----------------------------------------------------------------- forwarded by name
    @property
    def dataset(self) -> Any:
        stream = self._stream.dataset
        return stream.source if isinstance(stream, LogicalShardStream) else stream

    @property
    def elastic(self) -> bool:
        """Whether the stream is read as logical shards, so it may resume on other ranks and workers."""
        return isinstance(self._stream.dataset, LogicalShardStream)

    @property
    def collate_fn(self) -> Any:
        return self._stream.collate_fn

    @property
    def batch_size(self) -> int:
        return self._per_rank

    @property
    def total_batch_size(self) -> int:
        return self._per_rank * self.ctx.world_size

    @property
    def drop_last(self) -> bool:
        return self._drop_last

    def __len__(self) -> int:
        length = len(self.dataset)  # TypeError for a stream without a length, as with a DataLoader
        step = self._block()
        return length // step if self._drop_last else -(-length // step)

    def _block(self) -> int:
        """The stream items one worker batch takes: the global batch when every rank reads the whole stream."""
        return self.total_batch_size if self._sliced else self._per_rank

    # ----------------------------------------------------------------- position hooks
    def _batches(self) -> Iterator[Any]:
        source = self._open_pass()
        pending = next(source, None)
        while pending is not None:
            upcoming = next(source, None)  # read ahead: the end of a stream is only known by reading
            token, batch = pending
            self._commit(token)
            self.end_of_dataloader = upcoming is None
            yield self._place(batch)
            pending = upcoming

    def _open_pass(self) -> Iterator[tuple[tuple[int, int], Any]]:
        pos = self._position
        self._generation += 1
        snapshots, lines = agree_snapshots(self._stream.dataset, pos.snapshots)  # GlobalStream.agree
        if isinstance(self._stream.dataset, GlobalStream):
            lines += _stream_skips.already_delivered(
                snapshots, [(start, stop) for epoch, start, stop in self._unannounced if epoch == self._epoch])
            self._unannounced = [r for r in self._unannounced if r[0] > self._epoch]
            snapshots = _stream_skips.with_ranges(snapshots, _skips.of_epoch(self._skips, self._epoch))
            # The blocks dealt to the workers are one worker batch's items: the same batches on any num_workers.
            snapshots = _stream_skips.with_block(snapshots, _stream_skips.epoch_block(snapshots, self._block()))
            snapshots = _stream_skips.with_marks(snapshots)
        for line in lines if self.ctx.is_main else ():
            logger.warning("%s", line)
        starts = [
            WorkerStart(self._generation, w, self._epoch, pos.taken[w], snapshots[w])
            for w in range(pos.num_logical)
        ]
        generator_seed = mix_seed(self._seed, _WORKER_SALT)  # workers add (epoch, logical id)
        deals, holders = deal(starts, pos.next_rotation(), self._stream.readers, pos.shown,
                              worker_base_seed(generator_seed))
        self._pass = (self._generation, holders, starts)
        self._stream.start_pass(deals, self._epoch)
        self._worker_generator.manual_seed(generator_seed)
        for logical, number, batch in self._open_base():
            if logical is not None:  # not a MARKER, which stands for an empty slot
                yield (logical, number), batch

    def _commit(self, token: tuple[int, int]) -> None:
        logical, number = token
        self._position.taken[logical], self._position.last = number, logical

    def _batches_taken(self) -> int:
        return self._position.batches

    def _snapshots(self) -> list[Optional[dict]]:
        """Where each logical worker resumes: its start, or what it recorded after its last batch taken."""
        pos = self._position
        if self._pass is None:
            return list(pos.snapshots)
        generation, holders, starts = self._pass
        found = []
        for w, start in enumerate(starts):
            if pos.taken[w] == start.batches:
                found.append(start.state)
            else:
                found.append(self._stream.snapshot_of(generation, w, holders[w], pos.taken[w]))
        return found

    def _position_state(self) -> dict:
        pos = self._position
        return {
            S.BATCHES_YIELDED: pos.batches,
            STREAM: {
                "workers": pos.num_logical,
                "num_workers": pos.shown,
                "rotation": pos.next_rotation(),
                "taken": list(pos.taken),
                "snapshots": self._snapshots(),
                "stateful": self._stream.stateful,
                "reading": self._reading,
                **({"before": pos.before, "regrouped": [list(r) for r in pos.regrouped]} if pos.before else {}),
            },
            S.SKIPPED: [list(r) for r in self._skips],
        }

    def _config(self) -> dict:
        return {
            "batch_size": self._loader_batch_size,
            "dataset": type(self.dataset).__qualname__,
            "drop_last": self._drop_last,
            "split_batches": self._split_batches,
        }

    def _remainder(self) -> int:
        """How many real samples the epoch's last step holds, for ``gather_for_metrics``; -1 for unknown.

        With several workers slicing the stream, each pads its own last global batch, so no single count can
        say which samples are padding: then, as Accelerate does, the padding is kept (nothing real is lost).
        """
        try:
            length = len(self.dataset)
        except TypeError:
            return -1
        if self._sliced and self._position.num_logical > 1:
            steps = length // self.total_batch_size if self._drop_last else -(-length // self.total_batch_size)
            return (steps * self._per_rank) % self.total_batch_size
        return length % self.total_batch_size

    def _rebatch_refusal(self, state_dict: Mapping[str, Any]) -> Optional[str]:
        stream = state_dict.get(STREAM)
        if state_dict[S.BATCHES_YIELDED] == 0 and isinstance(stream, Mapping) and not any(stream.get("taken") or ()):
            return None  # an epoch nobody began: read at the new batch size as a fresh run reads it
        if state_dict[S.CONFIG].get("drop_last") and self._drop_last:
            # Each reader's saved place is after a whole batch of its share, and no batch is kept to pad the
            # epoch's end: the share goes on from there in batches of the new size, dropping its own tail.
            return None
        saved, current = self._batch_change(state_dict)
        return (
            f"the checkpoint was written with batch_size={saved}, this run has batch_size={current}, and it was "
            f"saved inside an epoch of a stream without drop_last, whose end is padded from the epoch's first "
            f"batch of {saved}, kept for it, which cannot pad batches of {current}; resume with "
            f"batch_size={saved} until the epoch ends, or run with DataLoader(drop_last=True) (then a stream may "
            "change its batch size anywhere), or start a fresh run"
        )

    def _check_position(self, state_dict: Mapping[str, Any], source: str) -> None:
        where = f" in {source}" if source else ""
        saved = state_dict[S.TOPOLOGY]
        stream = state_dict.get(STREAM)
        if not isinstance(stream, dict) or not isinstance(stream.get("snapshots"), list):
            raise UnsupportedConfigError(
                f"cannot resume{where}: the state has no valid '{STREAM}' entry; the file is damaged or was "
                "edited by hand, resume from another checkpoint"
            )
        rescaled = self._rescaled(state_dict)
        if rescaled:
            check_rescale(state_dict[S.TOPOLOGY], state_dict[STREAM], self._reader_now(), where)
        merged = self.elastic and rescaled
        if saved.get("world_size") == self.ctx.world_size and not merged and saved.get("rank") != self.ctx.rank:
            raise UnsupportedConfigError(
                f"cannot resume{where}: the state belongs to rank {saved.get('rank')}, this is rank "
                f"{self.ctx.rank}; load each rank's own state"
            )
        if not merged:
            check_shares(stream, saved, self._stream, where)
        taken, snapshots = stream.get("taken"), stream["snapshots"]
        if not (isinstance(taken, list) and len(taken) == len(snapshots) == stream["workers"]):
            raise UnsupportedConfigError(f"cannot resume{where}: inconsistent stream position {stream!r}")
        before, regrouped = stream.get("before", 0), stream.get("regrouped", [])
        if not (_whole(before) and isinstance(regrouped, list) and all(
                isinstance(r, list) and len(r) == 4 and all(_whole(v) for v in r) for r in regrouped)):
            raise UnsupportedConfigError(
                f"cannot resume{where}: the stream position's record of how its epoch was dealt to the workers is "
                "damaged; resume from another checkpoint")
        if before + sum(taken) != state_dict[S.BATCHES_YIELDED]:
            raise UnsupportedConfigError(
                f"cannot resume{where}: inconsistent position: the workers' batches add up to {before + sum(taken)}, "
                f"but batches_yielded={state_dict[S.BATCHES_YIELDED]}; resume from another checkpoint"
            )
        _stream_skips.saved_ranges(state_dict, where)  # (another dataset class is refused with the config)
        for epoch, start, stop in self._skips:  # given before the load: checked against the saved epoch
            _stream_skips.check_new(epoch, start, stop, current_epoch=state_dict[S.EPOCH])

    def _reader_now(self) -> Readers:
        return Readers(self._reading, self.ctx.world_size, self.num_workers, self._position.num_logical,
                       type(self.dataset).__name__)

    def _rescaled(self, state_dict: Mapping[str, Any]) -> bool:
        saved = state_dict[S.TOPOLOGY]
        return (saved.get("world_size"), saved.get("num_workers")) != (self.ctx.world_size, self.num_workers)

    def needs_all_ranks(self, state_dict: Mapping[str, Any]) -> bool:
        return self.elastic and self._rescaled(state_dict) and state_dict[S.TOPOLOGY].get("world_size", 1) > 1

    def merge_rank_states(self, states: list) -> Mapping[str, Any]:
        """Every saved rank's readers, as if one rank had read them all (logical shards only)."""
        merged = dict(super().merge_rank_states(states))
        snapshots = [snap for state in states for snap in state[STREAM]["snapshots"]]
        taken = [count for state in states for count in state[STREAM]["taken"]]
        merged[STREAM] = dict(merged[STREAM], snapshots=snapshots, taken=taken, workers=len(snapshots))
        merged[S.BATCHES_YIELDED] = sum(taken)
        return merged

    def _restore(self, state_dict: Mapping[str, Any]) -> None:
        stream = state_dict[STREAM]
        pos = self._position
        self._pass = None
        saved_skips = _stream_skips.saved_ranges(state_dict, "")
        self._skips = _skips.merged(saved_skips + [r for r in self._skips if r not in saved_skips])
        pos.last = None
        if self.elastic and self._rescaled(state_dict):
            # Elastic: every part's position, dealt out again to this topology's readers from its own position.
            table = {"items": 0, "ended": False, "dataset": merge_positions(stream["snapshots"])}
            pos.reset()
            pos.snapshots = [table] * pos.num_logical  # read only: each pass loads a copy (DatasetPosition.open)
            pos.rotation = 0
            return
        # Same topology, or one whole stream read by every rank on another number of processes: each logical
        # worker's stream position is global (a boundary of the global batches), so the new ranks slice the
        # next global batches at their own size from it.
        pos.num_logical, pos.shown = stream["workers"], shown_workers(stream, state_dict[S.TOPOLOGY])
        pos.taken = list(stream["taken"])
        pos.snapshots = list(stream["snapshots"])
        pos.rotation = stream["rotation"]
        pos.before = stream.get("before", 0)
        pos.regrouped = [list(r) for r in stream.get("regrouped", [])]
        if (pos.num_logical, pos.shown) != pos.own and not any(pos.taken) and not pos.before:
            pos.reset()  # an epoch not begun is read by this loader's own workers, as a fresh run reads it
        elif isinstance(self._stream.dataset, GlobalStream):
            self._regroup(stream, state_dict[S.EPOCH], state_dict[S.TOPOLOGY].get("world_size", 1))
        if not stream["stateful"]:
            self.replayed_samples = sum(s["items"] for s in pos.snapshots if s is not None and not s["ended"])
            if self.replayed_samples:
                logger.warning(
                    "%s has no state_dict()/load_state_dict(), so resuming reads and drops the %d samples "
                    "already consumed from it; implement them to resume without replay",
                    type(self.dataset).__name__, self.replayed_samples,
                )

    def _regroup(self, stream: Mapping[str, Any], epoch: int, saved_world: int) -> None:
        """On another number of workers or another block, the rest of a composable source's epoch from the first
        item no share handed out, dealt in this loader's own blocks (``_frontier``); as saved where it cannot be."""
        pos, block = self._position, self._block()
        if (pos.num_logical, pos.shown) == pos.own and _stream_skips.epoch_block(pos.snapshots, block) == block:
            return  # the same shares and blocks: they go on as saved
        found = None if _skips.of_epoch(self._skips, epoch) else _frontier.frontier(stream)
        if found is None:
            return
        snapshot, start, origin, old_block = found
        before, history = pos.batches, pos.regrouped + [[pos.before, origin, old_block, saved_world]]
        pos.reset()
        pos.before, pos.regrouped = before, history
        pos.snapshots = _frontier.regrouped(snapshot, start, block, pos.num_logical, _frontier.marks_of(stream))

    def _rewind(self) -> None:
        self._position.reset()
        self._pass = None

    def skip_samples(self, start: int, stop: int, epoch: Optional[int] = None) -> None:
        """Leave out the items of global indices ``start`` to ``stop - 1`` of an epoch, for good (a loss spike's rows).

        For the package's composable sources (``accelerate_stateful.sources``: ``Mixture``, ``Packed``,
        ``Shuffled``, ``exact_shuffle``), whose items have a global index, the same on every number of
        processes and workers; other streams are refused. The ranges are saved with the position, so every
        later resume (on any setup) leaves them out too. Call it on every process alike, between passes.
        Items of the range a worker share already delivered stay delivered (a warning says so).

        Args:
            start: The first index left out.
            stop: The index after the last one left out.
            epoch: The epoch; ``None``: the epoch the loader's position is in.

        Examples:
            >>> accelerator.resume()                                 # doctest: +SKIP
            >>> train_dl.skip_samples(40960, 43008)                  # doctest: +SKIP
        """
        self._refuse_if_live("skip_samples()")
        self._add_skip(self._epoch if epoch is None else epoch, start, stop, current_epoch=self._epoch)

    def _add_skip(self, epoch: int, start: int, stop: int, *, current_epoch: int) -> None:
        """Record a range left out (this loader's, or the dispatcher's when this loader is its reader)."""
        if not isinstance(self._stream.dataset, GlobalStream):
            super().skip_samples(start, stop, epoch)  # refused, with the reason
        _stream_skips.check_new(epoch, start, stop, current_epoch=current_epoch)
        self._skips = _skips.merged(self._skips + [[epoch, start, stop]])
        self._unannounced.append([epoch, start, stop])

    def _left_out(self) -> list[list[int]]:
        return self._skips

    def _seek(self, num_batches: int) -> None:
        raise UnsupportedConfigError(
            "skip_first_batches cannot move an iterable dataset without reading it; resume with "
            "accelerator.load_state()/resume(), which restores the stream's position instead"
        )


def _exact_hf_stream(dataset: Any) -> Any:
    """A ``datasets.IterableDataset`` with a shuffle buffer, read so that it resumes exactly (``sources._hf_streams``)."""
    if not type(dataset).__module__.startswith("datasets"):
        return dataset  # datasets is not imported for a dataset that is not one of its own
    from ..sources._hf_streams import exact_stream

    return exact_stream(dataset)


def shard_hf_iterable(dataset: Any, ctx: DistContext, split_batches: bool) -> tuple[Any, bool]:
    """Accelerate's choice: a ``datasets.IterableDataset`` with enough shards is split by shard, not sliced."""
    try:
        from datasets import IterableDataset as HFIterable
    except ImportError:
        return dataset, ctx.world_size > 1
    if (
        ctx.world_size > 1
        and isinstance(dataset, HFIterable)
        and not split_batches
        and dataset.n_shards >= ctx.world_size
    ):
        return dataset.shard(num_shards=ctx.world_size, index=ctx.rank), False
    return dataset, ctx.world_size > 1
