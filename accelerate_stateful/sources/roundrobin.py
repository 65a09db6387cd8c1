"""Round-robin dispatch of a non-replicable source: read in one place, transformed in the workers."""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator, Mapping, Optional, Union

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, default_collate

from .. import _log
from ..checkpoint import _state as S
from ..loaders._adapter import DataLoaderAdapter
from .._context import DistContext
from ..loaders._ordered import require_in_order
from ..loaders._workerinit import ShowingWorkerInit
from ..loaders._snapshot import DatasetPosition, is_stateful, set_epoch, unpack
from ..errors import StatefulLoaderError, UnsupportedConfigError

logger = _log.get_logger(__name__)

SOURCE = S.SOURCE
_SETTINGS = ("num_workers", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
             "prefetch_factor", "persistent_workers", "pin_memory_device")


class RoundRobinDataset(IterableDataset):
    """Marks a source that must not be copied into every worker or process: a stream, a cursor, a queue.

    Prepared by this package's ``Accelerator``, the source is read in exactly one
    place (the main process of rank 0), raw items are grouped into batches there,
    and the batches are handed to the ``num_workers`` workers round-robin in a
    fixed order; each worker applies ``transform`` (decoding, tokenising) to its
    items and collates them. The delivered order is therefore deterministic for
    a given worker count, and the source is never opened twice.

    Args:
        source: Either an iterable with ``state_dict()``/``load_state_dict()``
            (resumed exactly, nothing re-read), or a callable returning a fresh
            iterator (re-opened on resume and fast-forwarded over what was
            consumed, with a warning and a count of replayed items). It may have
            ``set_epoch(epoch)``.
        transform: Applied to each raw item in a worker; must be picklable when
            ``num_workers > 0``.

    Examples:
        >>> ds = RoundRobinDataset(KafkaLikeStream(topic), transform=tokenize)   # doctest: +SKIP
        >>> dl = accelerator.prepare(DataLoader(ds, batch_size=32, num_workers=4))   # doctest: +SKIP

    Iterated directly (outside ``prepare``), it reads the source and applies
    ``transform`` in the iterating process, like any iterable dataset.
    """

    def __init__(self, source: Union[Any, Callable[[], Iterator[Any]]], transform: Optional[Callable] = None) -> None:
        if not is_stateful(source) and not callable(source):
            raise UnsupportedConfigError(
                f"a round-robin source must implement state_dict()/load_state_dict() or be a callable returning a "
                f"fresh iterator (so it can be re-opened on resume); got {type(source).__name__}"
            )
        self.source = source
        self.transform = transform

    def open(self) -> Iterator[Any]:
        return iter(self.source) if is_stateful(self.source) else iter(self.source())

    def __iter__(self) -> Iterator[Any]:
        transform = self.transform or (lambda item: item)
        return (transform(item) for item in self.open())


class _Transform(Dataset):
    """What the workers see: 'index' ``raw`` is a raw item, and ``dataset[raw]`` transforms it."""

    def __init__(self, transform: Optional[Callable]) -> None:
        self.transform = transform

    def __getitem__(self, raw: Any) -> Any:
        return raw if self.transform is None else self.transform(raw)


class _SourceBatches(Sampler):
    """Reads raw items from the source in the main process, a batch at a time, recording its state after each."""

    def __init__(self, loader: "RoundRobinLoader") -> None:
        self._loader = loader

    def __iter__(self) -> Iterator[list]:
        return self._loader._read_batches()

    def __len__(self) -> int:
        raise TypeError("a round-robin source has no length")


class RoundRobinLoader(DataLoaderAdapter):
    """Loads a :class:`RoundRobinDataset` on one process (on several, the dispatcher wraps it).

    Batches reach the loop in the order they were read, whatever the number of
    workers (which may change between runs). Position: the batches the training
    loop took, and the source's state after reading them, recorded in the main process when each batch was read (the
    base loader reads ahead by its prefetch depth, so the state is kept for the
    batches in flight, at most ``prefetch_factor * num_workers + 2`` of them).
    """

    mode = S.ROUND_ROBIN_MODE

    def __init__(
        self,
        dataset: RoundRobinDataset,
        *,
        batch_size: int,
        ctx: DistContext,
        seed: int,
        seed_source: str,
        drop_last: bool = False,
        collate_fn: Optional[Callable] = None,
        device: Optional[torch.device] = None,
        non_blocking: bool = False,
        **loader_settings: Any,
    ) -> None:
        if ctx.world_size > 1:
            raise UnsupportedConfigError(
                "a RoundRobinDataset is read in one place: on several processes it needs dispatch_batches=True "
                "(Accelerate's default for iterable datasets), so that rank 0 reads it and sends each rank its part"
            )
        require_in_order(loader_settings)
        loader_settings.pop("in_order", None)
        if loader_settings.get("worker_init_fn") is not None:  # the workers run a transform stage, not the dataset
            loader_settings["worker_init_fn"] = ShowingWorkerInit(loader_settings["worker_init_fn"], dataset)
        base = DataLoader(
            _Transform(dataset.transform), batch_sampler=_SourceBatches(self), collate_fn=collate_fn or default_collate,
            **loader_settings,
        )
        super().__init__(base, ctx, seed=seed, seed_source=seed_source, device=device, non_blocking=non_blocking)
        self._dataset = dataset
        self._batch_size = batch_size
        self._drop_last = drop_last
        self._taken = 0
        self._source_state: Optional[dict] = None  # where the epoch's source resumes; None: its start
        self._position = DatasetPosition(dataset.source) if is_stateful(dataset.source) else None
        self._snapshots: dict[int, dict] = {}  # batches read but not yet taken: as many as the read-ahead
        self.replayed_samples = 0

    @classmethod
    def from_dataloader(cls, dataloader: DataLoader, ctx: Optional[DistContext] = None, *,
                        device: Optional[torch.device] = None, non_blocking: bool = False,
                        data_seed: Optional[int] = None, **_: Any) -> "RoundRobinLoader":
        from ..position._order import choose_seed

        ctx = ctx if ctx is not None else DistContext.detect()
        if dataloader.batch_size is None:
            raise UnsupportedConfigError("a RoundRobinDataset needs batch_size=... on its DataLoader")
        seed, seed_source = choose_seed(dataloader, data_seed, ctx)
        settings = {name: getattr(dataloader, name) for name in _SETTINGS if hasattr(dataloader, name)}
        return cls(
            dataloader.dataset, batch_size=dataloader.batch_size, ctx=ctx, seed=seed, seed_source=seed_source,
            drop_last=dataloader.drop_last, collate_fn=dataloader.collate_fn, device=device,
            non_blocking=non_blocking, in_order=getattr(dataloader, "in_order", True), **settings,
        )

    @property
    def dataset(self) -> RoundRobinDataset:
        return self._dataset

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def total_batch_size(self) -> int:
        return self._batch_size

    @property
    def drop_last(self) -> bool:
        return self._drop_last

    def __len__(self) -> int:
        raise TypeError("a round-robin source has no length")

    # ----------------------------------------------------------------- reading, in the main process
    def _read_batches(self) -> Iterator[list]:
        source = self._dataset.source
        replay = 0
        if self._position is not None:
            self._position.open(unpack(self._source_state)["dataset"] if self._source_state is not None else None)
        elif self._source_state is not None:
            replay = self._source_state["items"]
        set_epoch(source, self._epoch)
        stream = self._dataset.open()
        read = replay
        for _ in itertools.islice(stream, replay):
            pass
        for number in itertools.count(self._taken + 1):
            items = list(itertools.islice(stream, self._batch_size))
            read += len(items)
            if not items or (len(items) < self._batch_size and self._drop_last):
                return
            self._snapshots[number] = self._snapshot(read)
            yield items

    def _snapshot(self, read: int) -> dict:
        return self._position.record() if self._position is not None else {"items": read}

    # ----------------------------------------------------------------- position hooks
    def _batches(self) -> Iterator[Any]:
        source = self._open_pass()
        pending = next(source, None)
        while pending is not None:
            upcoming = next(source, None)
            token, batch = pending
            self._commit(token)
            self.end_of_dataloader = upcoming is None
            yield self._place(batch)
            pending = upcoming

    def _open_pass(self) -> Iterator[tuple[int, Any]]:
        self._snapshots = {}
        for number, batch in enumerate(self._open_base(), start=self._taken + 1):
            yield number, batch

    def _commit(self, token: int) -> None:
        if token not in self._snapshots:
            raise StatefulLoaderError(f"internal error: no source state recorded for batch {token}")
        for older in [number for number in self._snapshots if number < token]:
            del self._snapshots[older]
        self._taken, self._source_state = token, self._snapshots.pop(token)

    def _batches_taken(self) -> int:
        return self._taken

    def _position_state(self) -> dict:
        return {S.BATCHES_YIELDED: self._taken, SOURCE: unpack(self._source_state) if self._source_state else None}

    def _config(self) -> dict:
        return {"batch_size": self._batch_size, "drop_last": self._drop_last,
                "source": type(self._dataset.source).__qualname__}

    def _check_position(self, state_dict: Mapping[str, Any], source: str) -> None:
        saved = state_dict.get(SOURCE)
        if saved is not None and not isinstance(saved, Mapping):
            raise UnsupportedConfigError(f"cannot resume in {source}: invalid '{SOURCE}' entry {saved!r}")

    def _restore(self, state_dict: Mapping[str, Any]) -> None:
        self._taken = state_dict[S.BATCHES_YIELDED]
        self._source_state = state_dict.get(SOURCE)
        if self._source_state is not None and "items" in self._source_state:
            self.replayed_samples = self._source_state["items"]
            logger.warning(
                "%s has no state_dict()/load_state_dict(), so resuming re-opens it and reads and drops the %d items "
                "already consumed; implement them to resume without replay",
                type(self._dataset.source).__name__, self.replayed_samples,
            )

    def _rewind(self) -> None:
        self._taken, self._source_state, self._snapshots = 0, None, {}

    def _seek(self, num_batches: int) -> None:
        raise UnsupportedConfigError(
            "skip_first_batches cannot move a stream without reading it; resume with accelerator.load_state() or "
            "resume(), which restores the source's position instead"
        )
