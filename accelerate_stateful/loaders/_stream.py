"""Iterable sources read through DataLoader workers, with the position of what the loop took.

Each worker runs :class:`StreamDataset`, which wraps the user's iterable
dataset: it loads the worker's saved state, cuts the stream into batches
itself (the base loader runs with ``batch_size=None``), and tags every batch
with ``(logical worker, batch number)``. Right after a batch's last item is
read, it records the dataset's state in a small ring kept *in the worker*;
nothing is sent per batch but the two integers of the tag. When a checkpoint
is taken, the main process asks each worker for the state recorded after the
last batch the training loop took from it. A worker whose stream ended sends
its ring once, because the base loader may stop that worker before the
training loop has taken all of its batches (see ``_channels``; what a record
costs: ``_snapshot``).

The base loader hands batches out round-robin over workers (``in_order``),
skipping workers whose stream ended, so the delivered order is a pure
function of each worker's batches. A resumed pass maps physical worker ``j``
to logical worker ``(j + rotation) % num_workers``, where ``rotation`` is the
worker after the one that produced the last batch taken, so the continuation
is the uninterrupted order. The user's dataset sees the *logical* worker in
``get_worker_info()`` (torch keeps it in one module global, which the wrapper
sets), so a dataset that splits its stream by worker id reads the share of
the logical worker it plays. A pass that continues the logical workers of a run with another
``num_workers`` deals them to this run's workers instead (``_shares``).

A dataset without ``state_dict()`` is *opaque*: its position is the number of
items read, and resuming fast-forwards over them (counted as replayed).
"""

from __future__ import annotations

import itertools
import pickle
from typing import Any, Callable, Iterator, Optional

from torch.utils.data import IterableDataset, get_worker_info

from ._channels import Channels, Ring, WorkerStart
from ._first_batch import Rereader
from . import _stream_rng
from ._shares import Deal, play
from ._stream_rng import own_rng
from ..position._order import mix_seed
from ..training._rng import seed_globals
from ._snapshot import DatasetPosition, is_stateful, set_epoch, unpack
from ._workerinit import LogicalWorkerInit, show_dataset
from ..errors import StatefulLoaderError


def passthrough(batch: Any) -> Any:
    """Collate function of the base loader: batches are already collated in the worker."""
    return batch


class Slicer:
    """Accelerate's ``IterableDatasetShard``: this rank's slice of each global batch, padded at the end.

    Applied inside each worker, before batching, so a batch boundary of this
    rank is always a global-batch boundary of the stream.
    """

    def __init__(self, world_size: int, rank: int, per_rank: int, drop_last: bool) -> None:
        self.world_size, self.rank, self.per_rank, self.drop_last = world_size, rank, per_rank, drop_last

    @property
    def needed(self) -> int:
        """How many of the pass's first items this rank's padding can take: up to the end of its slice."""
        return (self.rank + 1) * self.per_rank

    def items(self, source: Iterator[Any], memo: dict) -> Iterator[Any]:
        """Yield this rank's items, the last global batch padded with the pass's first items.

        ``memo["first"]``: those items, from a checkpoint written before they were left out of it, or
        kept here when this pass reads its first global batch itself; ``memo["reread"]``: in a resumed
        pass, reads them again (``_first_batch``).
        """
        total = self.per_rank * self.world_size
        own = slice(self.rank * self.per_rank, self.needed)
        current: list = []
        for item in source:
            current.append(item)
            if len(current) == total:
                if memo.get("first") is None and memo.get("reread") is None and not self.drop_last:
                    memo["first"] = current[:self.needed]
                yield from current[own]
                current = []
        if self.drop_last or not current:
            return
        first, need = memo.get("first"), self.needed - len(current)
        if need > 0 and (first is None or len(first) < need) and memo.get("reread") is not None:
            first = memo["reread"](need)  # a checkpoint's batch of fewer ranks does not cover this rank's pad
        first = first or list(current)
        while len(current) < total:
            current += first
        yield from current[own]


class StreamDataset(IterableDataset):
    """Runs in each worker (or in the main process without workers): see the module docstring."""

    def __init__(
        self,
        dataset: IterableDataset,
        *,
        batch_size: int,
        drop_last: bool,
        collate_fn: Callable[[list], Any],
        num_workers: int,
        ring_size: int,
        slicer: Optional[Slicer] = None,
        mp_context: Any = None,
        shown: Any = None,
        worker_init: Optional[LogicalWorkerInit] = None,
    ) -> None:
        self.dataset = dataset
        self.shown = dataset if shown is None else shown  # what get_worker_info().dataset is: the user's dataset
        self.worker_init = worker_init
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.collate_fn = collate_fn
        self.slicer = slicer
        self.stateful = is_stateful(dataset)
        self._position = DatasetPosition(dataset) if self.stateful else None
        self._ring = Ring(ring_size)
        self._local_deal: Optional[Deal] = None
        self._floor = 0
        self._channels = Channels(num_workers, mp_context) if num_workers > 0 else None

    # ------------------------------------------------------------------ main-process side
    @property
    def readers(self) -> int:
        """The physical readers of a pass: the workers, or the main process."""
        return self._channels.num_workers if self._channels is not None else 1

    @property
    def in_workers(self) -> bool:
        return self._channels is not None

    @property
    def position(self) -> Optional[DatasetPosition]:
        return self._position

    def start_pass(self, deals: list[Deal], epoch: int) -> None:
        """Tell each physical reader which logical workers it plays in the next pass, and from where."""
        set_epoch(self.dataset, epoch)
        if self._channels is None:
            self._local_deal = deals[0]
            return
        self._floor = deals[0].generation  # workers created from now on copy it: older instructions are stale
        self._channels.forget()
        for physical, dealt in enumerate(deals):
            self._channels.instruct(physical, dealt)

    def snapshot_of(self, generation: int, logical: int, physical: int, batches: int) -> dict:
        """The snapshot worker ``logical`` took after its batch number ``batches`` in this pass."""
        key = (generation, logical, batches)
        if self._channels is None:
            found = self._ring.get(key)
        else:
            # Bytes from this loader's own worker process, as every batch of the base loader is.
            found = pickle.loads(self._channels.ask(physical, key))
        if found is None:
            raise StatefulLoaderError(
                f"internal error: worker {logical} no longer holds its state after batch {batches}; "
                "please report this with your DataLoader settings"
            )
        return unpack(found)

    # ------------------------------------------------------------------ worker side
    def __iter__(self) -> Iterator[Any]:
        info = _physical_worker_info()
        if info is None:
            dealt = self._local_deal or Deal(0, [WorkerStart(generation=0, logical=0)], 0, 0)
            if not dealt.plain(in_worker=False):
                return play(self, dealt, None)
            start = dealt.slots[0]
            return own_rng(self._batches(start, None), mix_seed(dealt.base_seed, start.epoch, start.logical))
        dealt = self._channels.instruction(info.id, self._floor)
        self._channels.serve(info.id, self._ring)
        if not dealt.plain(in_worker=True):
            return play(self, dealt, info.id)
        start = dealt.slots[0]
        if start is None:
            return iter(())  # more workers than logical workers: this one has none in this pass
        _play_worker(info, start.logical, start.epoch, self.shown, dealt.shown_workers)
        if self.worker_init is not None:
            self.worker_init.play(start.logical, self.shown)
        return self._batches(start, info.id)

    def _batches(self, start: WorkerStart, physical: Optional[int]) -> Iterator[Any]:
        yield from self.share_batches(start, self.dataset, self._position)
        if physical is not None:
            self.bequeath(physical, start.generation)

    def bequeath(self, physical: int, generation: int) -> None:
        """Send the main process this pass's snapshots before the base loader may stop this worker."""
        self._channels.bequeath(physical, self._ring.entries(generation))

    def share_batches(self, start: WorkerStart, dataset: Any,
                      position: Optional[DatasetPosition]) -> Iterator[Any]:
        """Logical worker ``start.logical``'s batches from ``dataset``, each recorded in the ring."""
        memo = {"first": (start.state or {}).get("first"), "reread": self._rereader(start, dataset, position)}
        items, read = self._open(start, dataset, position)
        # Every item read is in a batch (counted once per batch), but where a slicer reads items it does not hand
        # out (each counted as read).
        per_batch = self.slicer is None
        if not per_batch:
            items = self.slicer.items(_counted(items, read), memo)
        number = start.batches
        while True:
            batch = list(itertools.islice(items, self.batch_size))
            if per_batch:
                read[0] += len(batch)
            ended = len(batch) < self.batch_size
            if batch and not (ended and self.drop_last):
                number += 1
                key = (start.generation, start.logical, number)
                self._ring.put(key, self._snapshot(read, ended, position))
                yield (start.logical, number, self.collate_fn(batch))
            if ended:
                return

    def _open(self, start: WorkerStart, dataset: Any,
              position: Optional[DatasetPosition]) -> tuple[Iterator[Any], list]:
        """The user's stream positioned at ``start``, and a one-cell counter of the items read from it (those read
        to get there; ``share_batches`` counts the rest)."""
        read = [0]
        state = start.state
        if position is not None:
            position.open(state["dataset"] if state is not None else None)
        set_epoch(dataset, start.epoch, unless_set=True)  # the main process set it before workers started
        if state is not None and state["ended"] and not self.stateful:
            return iter(()), read  # an opaque stream known to be finished is not re-read to find its end
        skip = state["items"] if state is not None and not self.stateful else 0
        stream = iter(dataset)
        for _ in itertools.islice(stream, skip):  # opaque source: fast-forward, counted as replayed
            pass
        read[0] = skip
        if state is not None and "rng" in state:  # the stream's RNGs as they were after that batch
            _stream_rng.apply(state["rng"])
        return stream, read

    def _rereader(self, start: WorkerStart, dataset: Any,
                  position: Optional[DatasetPosition]) -> Optional[Rereader]:
        """For a resumed pass that may pad its last global batch without the first items at hand: their
        re-read, prepared before the saved position is loaded (``_first_batch``)."""
        state = start.state
        if self.slicer is None or self.drop_last or state is None or state["ended"]:
            return None
        if len(state.get("first") or ()) >= self.slicer.needed:
            return None  # a checkpoint written before the first items were left out of it
        return Rereader(dataset, position, start.epoch)

    def _snapshot(self, read: list, ended: bool, position: Optional[DatasetPosition]) -> dict:
        """The position after this batch, without the pass's first items (``_first_batch``): its size does not
        grow with the number of ranks. The parts it holds are never changed afterwards."""
        snapshot: dict = {"items": read[0], "ended": ended, "rng": _stream_rng.Taken()}
        if position is not None:
            snapshot.update(position.record())
        return snapshot


def _counted(items: Iterator[Any], read: list) -> Iterator[Any]:
    """``items``, each counted in ``read[0]`` as it is read."""
    for item in items:
        read[0] += 1
        yield item


_physical_info: Any = None  # this worker process's own WorkerInfo, before any logical worker was played


def _physical_worker_info() -> Any:
    return _physical_info if _physical_info is not None else get_worker_info()


def _play_worker(info: Any, logical: int, epoch: int, dataset: Any, num_workers: int) -> None:
    """Make this worker play ``logical`` of ``num_workers`` in ``epoch``: ``get_worker_info()`` reports it,
    its seed and the user's ``dataset``.

    The seed (``get_worker_info().seed``, ``torch.initial_seed()``, and the ``torch``, ``random`` and
    ``numpy`` global RNGs, re-seeded here at every pass) is a pure function of the loader's seed, the epoch
    and the logical worker: after a resume the worker that continues logical worker ``L`` draws what ``L``
    drew in the uninterrupted run (persistent workers too), so a per-worker shuffle seeded from it is
    reproduced.
    """
    global _physical_info
    _physical_info = info
    seed = mix_seed(info.seed - info.id, epoch, logical)  # info.seed - info.id: drawn from the loader's seed only
    seed_globals(seed)
    show_dataset(dataset, id=logical, seed=seed, num_workers=num_workers)
