"""Iterable sources read through DataLoader workers, with the position of what the loop took.

Each worker runs :class:`StreamDataset`, which wraps the user's iterable
dataset: it loads the worker's saved state, cuts the stream into batches
itself (the base loader runs with ``batch_size=None``), and tags every batch
with ``(logical worker, batch number)``. Right after a batch's last item is
read, it records the dataset's state in a small ring kept *in the worker*;
nothing is sent per batch but the two integers of the tag. When a checkpoint
is taken, the main process asks each worker for the state recorded after the
last batch the training loop took from it. A worker whose stream ended sends
its whole ring once, because the base loader may stop that worker before the
training loop has taken all of its batches.

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

import copy
import dataclasses
import itertools
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch.multiprocessing as torch_mp
from torch.utils.data import IterableDataset, get_worker_info

from .errors import StatefulLoaderError

REPLY_TIMEOUT_S = float(os.environ.get("ACCELERATE_STATEFUL_REPLY_TIMEOUT", 120))


def is_stateful(dataset: Any) -> bool:
    return callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))


def passthrough(batch: Any) -> Any:
    """Collate function of the base loader: batches are already collated in the worker."""
    return batch


@dataclass
class WorkerStart:
    """What one logical worker starts a pass from."""

    generation: int
    logical: int
    epoch: int = 0
    batches: int = 0  # batches this logical worker already delivered in the epoch
    state: Optional[dict] = None  # a snapshot taken by StreamDataset, or None for the stream's start


class _Ring:
    """The snapshots a worker took after its recent batches, keyed by (generation, batch number)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._entries: dict[tuple[int, int], dict] = {}
        self._lock = threading.Lock()

    def put(self, key: tuple[int, int], snapshot: dict) -> None:
        with self._lock:
            self._entries[key] = snapshot
            for old in [k for k in self._entries if k[0] != key[0] or k[1] <= key[1] - self._size]:
                del self._entries[old]

    def get(self, key: tuple[int, int]) -> Optional[dict]:
        with self._lock:
            return self._entries.get(key)

    def entries(self, generation: int) -> dict[tuple[int, int], dict]:
        with self._lock:
            return {k: v for k, v in self._entries.items() if k[0] == generation}


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
    ) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.collate_fn = collate_fn
        self.slicer = slicer
        self.stateful = is_stateful(dataset)
        self._initial: dict[int, Any] = {}
        if self.stateful:
            self._initial[os.getpid()] = copy.deepcopy(dataset.state_dict())
        self._ring = _Ring(ring_size)
        self._local_start: Optional[WorkerStart] = None
        self._channels = _Channels(num_workers, mp_context) if num_workers > 0 else None

    # ------------------------------------------------------------------ main-process side
    def start_pass(self, starts: list[WorkerStart], rotation: int) -> None:
        """Tell each physical worker which logical worker it plays in the next pass, and from where."""
        if self._channels is None:
            self._local_start = starts[0]
            return
        count = len(starts)
        self._channels.forget()
        for physical in range(count):
            self._channels.instruct(physical, starts[(physical + rotation) % count])

    def snapshot_of(self, generation: int, logical: int, physical: int, batches: int) -> dict:
        """The snapshot worker ``logical`` took after its batch number ``batches`` in this pass."""
        if self._channels is None:
            found = self._ring.get((generation, batches))
        else:
            found = self._channels.ask(physical, (generation, batches))
        if found is None:
            raise StatefulLoaderError(
                f"internal error: worker {logical} no longer holds its state after batch {batches}; "
                "please report this with your DataLoader settings"
            )
        return found

    # ------------------------------------------------------------------ worker side
    def __iter__(self) -> Iterator[Any]:
        info = _physical_worker_info()
        if info is None:
            return self._batches(self._local_start or WorkerStart(generation=0, logical=0), None)
        start = self._channels.instruction(info.id)
        self._channels.serve(info.id, self._ring)
        _play_worker(info, start.logical)
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
        if self.stateful:
            # The stream's start, recorded in this process before its first pass, is loaded for a fresh
            # pass too: a dataset restored once must not restart every later epoch from that position.
            initial = self._initial.setdefault(os.getpid(), copy.deepcopy(self.dataset.state_dict()))
            self.dataset.load_state_dict(copy.deepcopy(state["dataset"] if state is not None else initial))
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(start.epoch)
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
        snapshot: dict = {"items": read[0], "ended": ended}
        if self.stateful:
            snapshot["dataset"] = copy.deepcopy(self.dataset.state_dict())
        if memo.get("first") is not None:
            snapshot["first"] = memo["first"]
        return snapshot


_physical_info: Any = None  # this worker process's own WorkerInfo, before any logical worker was played


def _physical_worker_info() -> Any:
    return _physical_info if _physical_info is not None else get_worker_info()


def _play_worker(info: Any, logical: int) -> None:
    """Make ``get_worker_info()`` in this worker report ``logical`` as its id (and that worker's seed)."""
    from torch.utils.data._utils import worker as torch_worker

    global _physical_info
    _physical_info = info

    fields = {"id": logical, "seed": info.seed - info.id + logical}
    if dataclasses.is_dataclass(info):
        torch_worker._worker_info = dataclasses.replace(info, **fields)
    else:
        torch_worker._worker_info = type(info)(
            num_workers=info.num_workers, dataset=info.dataset, **fields
        )


class _Channels:
    """Pipes between the main process and each physical worker.

    Pipes rather than ``multiprocessing.Queue``: a queue's reader holds a lock
    shared by every process while it waits, and a worker that exits while its
    answering thread waits would leave that lock taken for the next pass's worker.
    """

    def __init__(self, num_workers: int, mp_context: Any = None) -> None:
        ctx = mp_context
        if ctx is None:
            ctx = torch_mp
        elif isinstance(ctx, str):
            ctx = torch_mp.get_context(ctx)
        self.num_workers = num_workers
        self._instructions = [ctx.Pipe(duplex=False) for _ in range(num_workers)]  # (worker end, main end)
        self._requests = [ctx.Pipe(duplex=True) for _ in range(num_workers)]  # (main end, worker end)
        self._serving: Optional[_Ring] = None
        self._send_lock = threading.Lock()
        self._bequests: dict[int, dict] = {}

    def instruct(self, physical: int, start: WorkerStart) -> None:
        self._instructions[physical][1].send(start)

    def instruction(self, physical: int) -> WorkerStart:
        """The newest instruction for this worker (older ones belong to passes abandoned before they began)."""
        reader = self._instructions[physical][0]
        if not reader.poll(REPLY_TIMEOUT_S):
            raise StatefulLoaderError(f"worker {physical} got no start instruction within {REPLY_TIMEOUT_S:.0f} s")
        start = reader.recv()
        while reader.poll():
            start = reader.recv()
        return start

    def ask(self, physical: int, key: tuple[int, int]) -> Optional[dict]:
        """The snapshot ``key`` of a worker: from what it left when its stream ended, or asked of it now."""
        conn = self._requests[physical][0]
        while conn.poll():  # collect what workers left behind without being asked
            self._receive(physical, conn.recv())
        if key in self._bequests.get(physical, {}):
            return self._bequests[physical][key]
        conn.send(key)
        while conn.poll(REPLY_TIMEOUT_S):
            message = conn.recv()
            self._receive(physical, message)
            if message[0] == "reply" and message[1] == key:
                return message[2]
            if key in self._bequests.get(physical, {}):
                return self._bequests[physical][key]
        raise StatefulLoaderError(
            f"worker {physical} did not report its state within {REPLY_TIMEOUT_S:.0f} s; it may have died "
            "(check its log) - the checkpoint cannot be taken"
        )

    def serve(self, physical: int, ring: _Ring) -> None:
        """Start (once per worker process) the thread that answers state requests from the ring."""
        if self._serving is ring:
            return
        self._serving = ring
        conn = self._requests[physical][1]

        def answer() -> None:
            while True:
                key = conn.recv()
                with self._send_lock:
                    conn.send(("reply", key, ring.get(key)))

        threading.Thread(target=answer, name="accelerate-stateful-state", daemon=True).start()

    def bequeath(self, physical: int, entries: dict) -> None:
        """Send the main process every snapshot of this pass before this worker may be stopped."""
        with self._send_lock:
            self._requests[physical][1].send(("bequest", entries))

    def forget(self) -> None:
        """Drop what workers of earlier passes left behind."""
        for physical, (conn, _) in enumerate(self._requests):
            while conn.poll():
                conn.recv()
        self._bequests.clear()

    def _receive(self, physical: int, message: tuple) -> None:
        if message[0] == "bequest":
            self._bequests.setdefault(physical, {}).update(message[1])

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_serving"] = None
        state["_send_lock"] = None
        state["_bequests"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._send_lock = threading.Lock()
