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
the logical worker it plays.

A dataset without ``state_dict()`` is *opaque*: its position is the number of
items read, and resuming fast-forwards over them (counted as replayed).
"""

from __future__ import annotations

import itertools
import pickle
from typing import Any, Callable, Iterator, Optional

from torch.utils.data import IterableDataset, get_worker_info

from ._channels import Channels, Ring, WorkerStart
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

    def items(self, source: Iterator[Any], memo: dict) -> Iterator[Any]:
        """Yield this rank's items; ``memo["first"]`` keeps the first global batch for the padding."""
        total = self.per_rank * self.world_size
        own = slice(self.rank * self.per_rank, (self.rank + 1) * self.per_rank)
        current: list = []
        for item in source:
            current.append(item)
            if len(current) == total:
                if memo.get("first") is None and not self.drop_last:
                    memo["first"] = list(current)
                yield from current[own]
                current = []
        if self.drop_last or not current:
            return
        first = memo.get("first") or list(current)
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
        self._local_start: Optional[WorkerStart] = None
        self._floor = 0
        self._channels = Channels(num_workers, mp_context) if num_workers > 0 else None

    # ------------------------------------------------------------------ main-process side
    def start_pass(self, starts: list[WorkerStart], rotation: int) -> None:
        """Tell each physical worker which logical worker it plays in the next pass, and from where."""
        set_epoch(self.dataset, starts[0].epoch)
        if self._channels is None:
            self._local_start = starts[0]
            return
        count = len(starts)
        self._floor = starts[0].generation  # workers created from now on copy it: older instructions are stale
        self._channels.forget()
        for physical in range(count):
            self._channels.instruct(physical, starts[(physical + rotation) % count])

    def snapshot_of(self, generation: int, logical: int, physical: int, batches: int) -> dict:
        """The snapshot worker ``logical`` took after its batch number ``batches`` in this pass."""
        if self._channels is None:
            found = self._ring.get((generation, batches))
        else:
            # Bytes from this loader's own worker process, as every batch of the base loader is.
            found = pickle.loads(self._channels.ask(physical, (generation, batches)))
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
            return self._batches(self._local_start or WorkerStart(generation=0, logical=0), None)
        start = self._channels.instruction(info.id, self._floor)
        self._channels.serve(info.id, self._ring)
        _play_worker(info, start.logical, start.epoch, self.shown)
        if self.worker_init is not None:
            self.worker_init.play(start.logical, self.shown)
        return self._batches(start, info.id)

    def _batches(self, start: WorkerStart, physical: Optional[int]) -> Iterator[Any]:
        memo = {"first": (start.state or {}).get("first")}
        items, read = self._open(start)
        if self.slicer is not None:
            items = self.slicer.items(items, memo)
        number = start.batches
        while True:
            batch = list(itertools.islice(items, self.batch_size))
            ended = len(batch) < self.batch_size
            if batch and not (ended and self.drop_last):
                number += 1
                self._ring.put((start.generation, number), self._snapshot(read, memo, ended))
                yield (start.logical, number, self.collate_fn(batch))
            if ended:
                if physical is not None:
                    self._channels.bequeath(physical, self._ring.entries(start.generation))
                return

    def _open(self, start: WorkerStart) -> tuple[Iterator[Any], list]:
        """The user's stream positioned at ``start``, and a one-cell counter of items read from it."""
        read = [0]
        state = start.state
        if self._position is not None:
            self._position.open(state["dataset"] if state is not None else None)
        set_epoch(self.dataset, start.epoch, unless_set=True)  # the main process set it before workers started
        if state is not None and state["ended"] and not self.stateful:
            return iter(()), read  # an opaque stream known to be finished is not re-read to find its end
        skip = state["items"] if state is not None and not self.stateful else 0
        stream = iter(self.dataset)
        for _ in itertools.islice(stream, skip):  # opaque source: fast-forward, counted as replayed
            pass
        read[0] = skip

        def counted() -> Iterator[Any]:
            for item in stream:
                read[0] += 1
                yield item

        return counted(), read

    def _snapshot(self, read: list, memo: dict, ended: bool) -> dict:
        """The position after this batch; the parts it holds are never changed afterwards."""
        snapshot: dict = {"items": read[0], "ended": ended}
        if self._position is not None:
            snapshot.update(self._position.record())
        if memo.get("first") is not None:
            snapshot["first"] = memo["first"]  # set once per pass, never changed
        return snapshot


_physical_info: Any = None  # this worker process's own WorkerInfo, before any logical worker was played


def _physical_worker_info() -> Any:
    return _physical_info if _physical_info is not None else get_worker_info()


def _play_worker(info: Any, logical: int, epoch: int, dataset: Any) -> None:
    """Make this worker play ``logical`` in ``epoch``: ``get_worker_info()`` reports it, its seed and the
    user's ``dataset``.

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
    show_dataset(dataset, id=logical, seed=seed)
