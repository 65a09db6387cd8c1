"""Positions recorded after every batch, put in their JSON-able form only when read.

The loader records a stream's position after each batch and keeps the last few;
a checkpoint reads one of them, most are dropped. A part of a position that is
costly to put in its JSON-able form (a shuffle buffer's 10,000 slot numbers as a
tuple: 18 µs, against 2 µs to copy them as machine integers) is recorded as a
:class:`Deferred` holding what it takes to make it (a private copy; for a full
shuffle buffer, a copy shared by the records of up to ``buffer_size`` draws and
the draw count: ``_draws.Replayed``), and turned into the JSON-able value
when the record is read (:func:`settled`) or pickled (a worker's records reach
the main process pickled). Either way what is read equals what ``position()``
would have returned at the record. The stream's RNG states taken after each batch
(``loaders/_stream_rng.Taken``) are deferred the same way.
"""

from __future__ import annotations

from typing import Any


class Deferred:
    """A recorded part of a position, in a cheap form of its own; :meth:`settled` gives the JSON-able value."""

    __slots__ = ()

    def settled(self) -> Any:
        raise NotImplementedError

    def __reduce__(self) -> tuple:
        return _same, (self.settled(),)


class IntsAsTuple(Deferred):
    """A private copy of a sequence of ints (an ``array.array``, say), read as a tuple."""

    __slots__ = ("_ints",)

    def __init__(self, ints: Any) -> None:
        self._ints = ints

    def settled(self) -> tuple:
        return tuple(self._ints)


class Prefix(Deferred):
    """The first ``n`` ints of an ``array.array`` that is only ever appended to, read as a list: recorded
    without a copy of a log that grows through a pass."""

    __slots__ = ("_ints", "_n")

    def __init__(self, ints: Any, n: int) -> None:
        self._ints, self._n = ints, n

    def settled(self) -> list:
        return self._ints[:self._n].tolist()


def _same(value: Any) -> Any:
    return value


def settled(value: Any) -> Any:
    """``value`` with every :class:`Deferred` in it or in its nested dicts replaced by its JSON-able value (a
    record's deferred parts are values of dicts; a user's lists are not walked). The same object where none is."""
    if isinstance(value, Deferred):
        return value.settled()
    if isinstance(value, dict):
        found = {key: settled(item) for key, item in value.items()}
        return value if all(found[key] is item for key, item in value.items()) else found
    return value


def recorded(cursor: Any) -> Any:
    """A cursor's position as recorded after a batch: its ``recorded()`` where it has one, else ``position()``."""
    record = getattr(cursor, "recorded", None)
    return record() if record is not None else cursor.position()
