"""The position of a stateful dataset: where a pass starts, and a record of it after each batch.

A record costs one ``state_dict()`` call. A dataset whose ``state_dict()``
builds a new state at each call (no list, dict, tensor or object shared
between two calls: checked once per process) is recorded as returned; one
that returns live parts of itself is pickled at once, by value, since those
parts change under a reference as it reads on. Records cross processes only
as pickled bytes made by the loader's own processes, as every batch of a
``DataLoader`` does; checkpoint files never hold a pickle.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
import pickle
from typing import Any, Iterator, Optional

from ..sources._recorded import settled


def is_stateful(dataset: Any) -> bool:
    return callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))


def set_epoch(dataset: Any, epoch: int, *, unless_set: bool = False) -> None:
    """Call ``dataset.set_epoch(epoch)`` if it has one; with ``unless_set``, only if it reports another epoch.

    The main process sets the epoch before workers start, and a worker calls it
    only where its copy does not report that epoch: in ``datasets``,
    ``set_epoch`` is a relative update of memory that persistent workers share,
    and concurrent calls would add the step twice.
    """
    if not callable(getattr(dataset, "set_epoch", None)):
        return
    if not unless_set or getattr(dataset, "epoch", None) != epoch:
        dataset.set_epoch(epoch)


class DatasetPosition:
    """Positions a stateful dataset at the start of each pass and records it after each batch.

    Keyed by process: an object copied into a worker process keeps track of
    that process's dataset.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self._initial: dict[int, Any] = {os.getpid(): copy.deepcopy(dataset.state_dict())}
        self._opened: set[int] = set()  # processes in which the dataset was read
        self._fresh: dict[int, bool] = {}  # per process: does state_dict() build a new state at each call?

    def open(self, saved: Optional[Any]) -> None:
        """Load ``saved``, or for a fresh pass the state the dataset had before this process read it.

        A dataset that continues from where it stopped, or that was restored once, must not start the
        next epoch there. The first pass in a process leaves the dataset as it is: its state may describe
        examples read before prepare (a peek), which its own ``iter()`` reads again.
        """
        pid = os.getpid()
        initial = self._initial.setdefault(pid, copy.deepcopy(self.dataset.state_dict()))
        if saved is not None:
            self.dataset.load_state_dict(copy.deepcopy(saved))
        elif pid in self._opened:
            self.dataset.load_state_dict(copy.deepcopy(initial))
        self._opened.add(pid)

    @contextlib.contextmanager
    def at_pass_start(self) -> Iterator[Any]:
        """The dataset where :meth:`open` starts a fresh pass in this process, for the block; then back in the
        state it had (``_first_batch`` reads a resumed pass's first items again after its end)."""
        now = copy.deepcopy(self.dataset.state_dict())
        pid = os.getpid()
        if pid in self._opened:
            self.dataset.load_state_dict(copy.deepcopy(self._initial[pid]))
        try:
            yield self.dataset
        finally:
            self.dataset.load_state_dict(now)

    def fork(self) -> "DatasetPosition":
        """A position over a copy of the dataset that starts where this one starts (another logical
        worker read in this process, see ``_shares``)."""
        pid = os.getpid()
        twin = DatasetPosition.__new__(DatasetPosition)
        twin.dataset = copy.deepcopy(self.dataset)
        twin._initial = {pid: self._initial.setdefault(pid, copy.deepcopy(self.dataset.state_dict()))}
        twin._opened = {pid}  # a fresh pass loads the initial state: the copy may have been read already
        twin._fresh = dict(self._fresh)
        return twin

    def record(self) -> dict:
        """``{"dataset": state}``, or ``{"pickled": bytes}`` where the state would change under a reference.

        A source of this package is recorded through ``recorded_state()``, whose costly parts are put in their
        JSON-able form only when read (:func:`unpack`) or pickled (``sources/_recorded``)."""
        take = getattr(self.dataset, "recorded_state", None) or self.dataset.state_dict
        state = take()
        pid = os.getpid()
        if pid not in self._fresh:
            self._fresh[pid] = not shares_mutable_parts(state, take())
        if self._fresh[pid]:
            return {"dataset": state}
        return {"pickled": pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)}


def unpack(record: dict) -> dict:
    """A record (or a snapshot holding one) with its state, and every part deferred to now, as checkpoint data."""
    if "pickled" not in record:
        return settled(record)
    found = settled({key: value for key, value in record.items() if key != "pickled"})
    found["dataset"] = pickle.loads(record["pickled"])  # made by this loader's own process
    return found


_IMMUTABLE = (int, float, complex, str, bytes, bool, type(None), range, frozenset)


def shares_mutable_parts(first: Any, second: Any) -> bool:
    """Whether two states returned by ``state_dict()`` share a part that could still change in place.

    Containers and other objects are compared by identity (objects through their attributes too),
    tensors and arrays by the memory they view. A false "shared" only costs a copy per batch.
    """

    def parts(value: Any, found: set, seen: set) -> None:
        if isinstance(value, _IMMUTABLE) or id(value) in seen:
            return
        seen.add(id(value))
        if not isinstance(value, tuple):
            found.add(("id", id(value)))
        if callable(getattr(value, "untyped_storage", None)):
            found.add(("memory", value.untyped_storage().data_ptr()))
            return
        interface = getattr(value, "__array_interface__", None)
        if isinstance(interface, dict):
            found.add(("memory", interface["data"][0]))
            return
        if isinstance(value, dict):
            children: Iterator[Any] = itertools.chain(value.keys(), value.values())
        elif isinstance(value, (list, tuple, set)):
            children = iter(value)
        else:
            children = iter(getattr(value, "__dict__", {}).values())
        for child in children:
            parts(child, found, seen)

    a: set = set()
    b: set = set()
    parts(first, a, set())
    parts(second, b, set())
    return not a.isdisjoint(b)
