"""Pipes between the main process and the workers of a stream loader.

The main process sends each worker the instruction for a pass (which logical
worker it plays, from where); a worker keeps its recent snapshots in a
:class:`Ring` and sends them only when asked, or all at once when its stream
ends. Both directions are served by threads, so neither side ever waits for
the other to read: an instruction may carry a large state for a worker that
has not started yet, and a worker whose stream ended sends its ring while the
main process may be waiting for that worker inside the base loader.

Everything crosses as pickled bytes (by value: a tensor must not refer to the
memory of a worker that may have exited), made by this loader's own processes.
"""

from __future__ import annotations

import pickle
import queue
import threading
import weakref
from multiprocessing.connection import wait as wait_for_messages
from dataclasses import dataclass
from typing import Any, Optional

import torch.multiprocessing as torch_mp

from .._context import package_timeout
from ..errors import StatefulLoaderError

REPLY_TIMEOUT_ENV = "ACCELERATE_STATEFUL_REPLY_TIMEOUT"
REPLY_TIMEOUT_S = 120.0  # without a process group; with one, half its collective timeout


def reply_timeout() -> float:
    """How long to wait for a worker: a state request runs inside ``save_state``'s ``agree``, so its error
    must reach the other ranks before the collective they wait in gives up (``_context.package_timeout``)."""
    return package_timeout(REPLY_TIMEOUT_ENV, REPLY_TIMEOUT_S)



@dataclass
class WorkerStart:
    """What one logical worker starts a pass from."""

    generation: int
    logical: int
    epoch: int = 0
    batches: int = 0  # batches this logical worker already delivered in the epoch
    state: Optional[dict] = None  # a snapshot taken by StreamDataset, or None for the stream's start

class Ring:
    """The snapshots a worker took after its recent batches, keyed by (generation, logical worker, batch
    number): a worker may play several logical workers in one pass (``_shares``); each keeps ``size``."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._entries: dict[tuple[int, int, int], dict] = {}
        self._lock = threading.Lock()

    def put(self, key: tuple[int, int, int], snapshot: dict) -> None:
        with self._lock:
            self._entries[key] = snapshot
            for old in [k for k in self._entries
                        if k[0] != key[0] or (k[1] == key[1] and k[2] <= key[2] - self._size)]:
                del self._entries[old]

    def get(self, key: tuple[int, int, int]) -> Optional[dict]:
        with self._lock:
            return self._entries.get(key)

    def entries(self, generation: int) -> dict[tuple[int, int, int], dict]:
        with self._lock:
            return {k: v for k, v in self._entries.items() if k[0] == generation}


class _Mailbox:
    """What workers sent the main process: replies to requests and the rings of finished streams."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.bequests: dict[int, dict[tuple[int, int], bytes]] = {}  # kept for the pass: asked again later
        self.replies: dict[int, dict[tuple[int, int], bytes]] = {}  # taken by the request that wanted them

    def find(self, physical: int, key: tuple[int, int]) -> Optional[bytes]:
        found = self.bequests.get(physical, {}).get(key)
        return found if found is not None else self.replies.get(physical, {}).pop(key, None)

    def has(self, physical: int, key: tuple[int, int]) -> bool:
        return key in self.bequests.get(physical, {}) or key in self.replies.get(physical, {})


def _collect(conns: list, mailbox: _Mailbox, owner: "weakref.ref[Channels]") -> None:
    """Receive everything workers send, as soon as they send it, until the channels are dropped.

    Workers must never wait for the main process to read: a worker whose stream
    ended sends its ring before it reports the end, and the main process may be
    waiting for that report inside the base loader.
    """
    open_conns = {conn: physical for physical, conn in enumerate(conns)}
    while open_conns and owner() is not None:
        for conn in wait_for_messages(list(open_conns), timeout=0.5):
            try:
                kind, snapshots = conn.recv()
            except (EOFError, OSError):
                del open_conns[conn]
                continue
            with mailbox.changed:
                if kind == "bequest":
                    mailbox.bequests.setdefault(open_conns[conn], {}).update(snapshots)
                else:  # only the newest reply is kept: an older one was answered or given up on
                    mailbox.replies[open_conns[conn]] = snapshots
                mailbox.changed.notify_all()


def _deliver(conns: list, outbox: queue.SimpleQueue, owner: "weakref.ref[Channels]") -> None:
    """Send queued instructions in order, until the channels are dropped."""
    while owner() is not None:
        try:
            physical, message = outbox.get(timeout=0.5)
        except queue.Empty:
            continue
        try:
            conns[physical].send_bytes(message)
        except OSError:
            return


class Channels:
    """Pipes between the main process and each physical worker.

    Pipes rather than ``multiprocessing.Queue``: a queue's reader holds a lock
    shared by every process while it waits, and a worker that exits while its
    answering thread waits would leave that lock taken for the next pass's worker.
    Every message a worker sends is ``(kind, {key: pickled snapshot})``.
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
        self._serving: Optional[Ring] = None
        self._send_lock = threading.Lock()
        self._mailbox: Optional[_Mailbox] = None
        self._outbox: Optional[queue.SimpleQueue] = None

    # ------------------------------------------------------------------ main-process side
    def instruct(self, physical: int, start: WorkerStart) -> None:
        """Queue ``start`` for a worker; a thread sends it, so a large state never blocks this process
        while the worker that will read it has not started yet."""
        self._collecting()
        if self._outbox is None:
            self._outbox = queue.SimpleQueue()
            conns = [main_end for _, main_end in self._instructions]
            threading.Thread(
                target=_deliver, args=(conns, self._outbox, weakref.ref(self)),
                name="accelerate-stateful-deliver", daemon=True,
            ).start()
        self._outbox.put((physical, _pickle(start)))

    def ask(self, physical: int, key: tuple[int, int]) -> bytes:
        """The snapshot ``key`` of a worker, pickled: from what it left when its stream ended, or asked now."""
        mailbox, timeout = self._collecting(), reply_timeout()
        with mailbox.changed:
            if not mailbox.has(physical, key):
                self._requests[physical][0].send(key)
                mailbox.changed.wait_for(lambda: mailbox.has(physical, key), timeout)
            found = mailbox.find(physical, key)
        if found is None:
            raise StatefulLoaderError(
                f"worker {physical} did not report its state within {timeout:.0f} s; it may have died "
                "(check its log) - the checkpoint cannot be taken"
            )
        return found

    def forget(self) -> None:
        """Drop what workers of earlier passes sent."""
        mailbox = self._collecting()
        with mailbox.changed:
            mailbox.bequests.clear()
            mailbox.replies.clear()

    def _collecting(self) -> _Mailbox:
        if self._mailbox is None:
            self._mailbox = _Mailbox()
            conns = [main_end for main_end, _ in self._requests]
            threading.Thread(
                target=_collect, args=(conns, self._mailbox, weakref.ref(self)),
                name="accelerate-stateful-collect", daemon=True,
            ).start()
        return self._mailbox

    # ------------------------------------------------------------------ worker side
    def instruction(self, physical: int, floor: int) -> WorkerStart:
        """The newest instruction for this worker, of pass ``floor`` or later (older ones, and those
        already waiting behind, belong to passes abandoned before their workers began)."""
        reader = self._instructions[physical][0]
        start: Optional[WorkerStart] = None
        while start is None or start.generation < floor or reader.poll():
            if not reader.poll(timeout := reply_timeout()):
                raise StatefulLoaderError(
                    f"worker {physical} got no start instruction within {timeout:.0f} s"
                )
            start = pickle.loads(reader.recv_bytes())  # sent by this loader's main process
        return start

    def serve(self, physical: int, ring: Ring) -> None:
        """Start (once per worker process) the thread that answers state requests from the ring."""
        if self._serving is ring:
            return
        self._serving = ring
        conn = self._requests[physical][1]

        def answer() -> None:
            while True:
                key = conn.recv()
                self._send(physical, "reply", {key: _pickle(ring.get(key))})

        threading.Thread(target=answer, name="accelerate-stateful-state", daemon=True).start()

    def bequeath(self, physical: int, entries: dict) -> None:
        """Send the main process every snapshot of this pass before this worker may be stopped."""
        self._send(physical, "bequest", {key: _pickle(snapshot) for key, snapshot in entries.items()})

    def _send(self, physical: int, kind: str, snapshots: dict) -> None:
        with self._send_lock:
            self._requests[physical][1].send((kind, snapshots))

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_serving"] = None
        state["_send_lock"] = None
        state["_mailbox"] = None
        state["_outbox"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._send_lock = threading.Lock()


def _pickle(snapshot: Optional[dict]) -> bytes:
    """By value: a tensor in it must not refer to the memory of a worker that may have exited."""
    return pickle.dumps(snapshot, protocol=pickle.HIGHEST_PROTOCOL)
