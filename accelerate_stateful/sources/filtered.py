"""Filtering: the items of a source that pass a predicate, resumed exactly and elastically.

Item ``k`` of a :class:`Filtered` is the ``k``-th item of its source's order that the predicate keeps, a pure
function of the source's sequence and the predicate. The position counts the items *drawn* from the source,
kept and dropped alike, and holds the source's own position after the last one drawn: a resume opens the
source there, so no item is tested twice, none is skipped, and a run of dropped items before the save point
is not read again. A dropped item counts as drawn, not delivered, as a skip range does (``_global``).
"""

from __future__ import annotations

import copy
import pickle
from typing import Any, Callable, Optional

from ..errors import CheckpointError, UnsupportedConfigError
from ._global import Cursor, GlobalStream, check_child, check_source, open_source, plain_copy
from ._merge import drawn_kept

_POSITION_KEYS = {"source", "kept", "dropped"}


class Filtered(GlobalStream):
    """The items of ``source`` for which ``predicate(item)`` is true, in the source's order.

    A composable source like ``Mixture``, ``Packed`` and ``Shuffled``: a loader's dataset, a child of any of
    them, or wrapping them (``Filtered(Mixture(...), keep)``, ``Packed(Filtered(docs, long_enough), ...)``).
    Read by ``DataLoader`` workers, each reads the whole source and keeps its share of the kept items, so
    the predicate runs once per worker for each item; resumed on any number of processes or workers, the
    sequence goes on.

    Args:
        source: What to filter: a map-style dataset, a ``datasets.Dataset`` or ``IterableDataset``, a
            stateful iterable or another of this package's sources.
        predicate: ``predicate(item) -> bool``, a pure function of the item (no randomness, no counter of
            its own), the same on every process. With ``DataLoader`` workers started by ``spawn`` or
            ``forkserver`` it must be picklable: a function defined at a module's top level, not a lambda.

    Position (the ``"position"`` of ``state_dict()``): ``source`` (the source's position after the last item
    drawn), ``kept`` and ``dropped`` (the items drawn from the source in this epoch that the predicate kept
    and dropped; their sum is the items drawn). Under a ``Mixture`` the same counts sit in the mixture's
    ``sources`` entry for that source, next to its ``drawn`` and ``delivered`` counts. As a loader's outermost
    source, each worker share also notes at the end of each worker batch it hands out the items drawn and kept
    so far (``"marks"`` of ``state_dict()``, two integers and the index a batch): ``samples --step N`` names
    the source items a step's rows were kept from by them.

    Examples:
        >>> docs = [{"text": "hi"}, {"text": "a longer one"}, {"text": "ok"}, {"text": "long enough"}]
        >>> stream = Filtered(docs, lambda doc: len(doc["text"]) > 5)
        >>> [doc["text"] for doc in stream]
        ['a longer one', 'long enough']
        >>> stream.counts()
        {'kept': 2, 'dropped': 2}
    """

    def __init__(self, source: Any, predicate: Callable[[Any], Any]) -> None:
        if not callable(predicate):
            raise UnsupportedConfigError(
                f"Filtered(predicate={predicate!r:.60}): the predicate must be a function of an item that returns "
                "True to keep it, like Filtered(source, lambda item: len(item['text']) > 100)"
            )
        check_source(source, "Filtered's source")
        self.source, self.predicate = source, predicate

    def settings(self) -> dict[str, Any]:
        return {"predicate": _name(self.predicate)}

    def children(self) -> dict[str, Any]:
        return {"source": self.source}

    def check_position(self, position: Any) -> None:
        check_child(self.source, _checked(position)["source"])

    def open(self, position: Optional[Any], epoch: int) -> Cursor:
        start = _checked(position) if position is not None else {"source": None, "kept": 0, "dropped": 0}
        return _FilterCursor(self, open_source(self.source, start["source"], epoch), start)

    def agree(self, positions: list) -> tuple[list, list[str]]:
        """Passed on to the source when it is a global sequence (``GlobalStream.agree``): a share's source
        position is where its filter has drawn to, which is what the source's shares agree on."""
        if not isinstance(self.source, GlobalStream):
            return positions, []
        below, lines = self.source.agree([None if p is None else p["source"] for p in positions])
        agreed = [
            None if position is None and child is None
            else dict(position or {"kept": 0, "dropped": 0}, source=child)
            for position, child in zip(positions, below)
        ]
        return agreed, lines

    def counts(self, state: Optional[Any] = None) -> dict[str, int]:
        """The items drawn from the source in the epoch that the predicate kept and dropped.

        Args:
            state: A ``state_dict()`` of this source or its ``"position"`` (a ``Mixture``'s ``sources`` entry
                for it, say). ``None``: this object's own position (what it drew when iterated here).
        """
        state = self.state_dict() if state is None else state
        position = state.get("position", state) if isinstance(state, dict) and "index" in state else state
        if position is None:
            return {"kept": 0, "dropped": 0}
        found = _checked(position)
        return {"kept": found["kept"], "dropped": found["dropped"]}

    def __getstate__(self) -> dict:
        """Pickled (``DataLoader`` workers started by ``spawn`` or ``forkserver``): refuse a predicate that
        cannot travel, in the user's terms, instead of the pickler's error about a local object."""
        try:
            pickle.dumps(self.predicate)
        except Exception as exc:  # what pickling a function raises varies: PicklingError, AttributeError, TypeError
            raise UnsupportedConfigError(
                f"the predicate {_name(self.predicate)} of a Filtered cannot be sent to DataLoader workers ({exc}); "
                "define it with def at the top level of a module (a lambda or a function defined inside another "
                "cannot be pickled), or use num_workers=0, or multiprocessing_context='fork'"
            ) from exc
        return super().__getstate__()

    def __deepcopy__(self, memo: dict) -> "Filtered":
        """A copy within this process: the predicate is shared, never pickled."""
        twin = object.__new__(type(self))
        memo[id(self)] = twin
        twin.__dict__.update(copy.deepcopy(GlobalStream.__getstate__(self), memo))
        return twin


class _FilterCursor:
    """The source's items that pass the predicate, counting every item drawn."""

    def __init__(self, owner: Filtered, source: Cursor, start: dict) -> None:
        self._owner, self._source, self._start = owner, source, start
        self._kept, self._dropped = start["kept"], start["dropped"]
        self._moved = False  # whether a source item was drawn here (before that, the position is the start)

    def __next__(self) -> Any:
        while True:
            item = next(self._source)  # StopIteration: the source ended, and so does this sequence
            self._moved = True
            if self._keeps(item):
                self._kept += 1
                return item
            self._dropped += 1

    def _keeps(self, item: Any) -> bool:
        try:
            return bool(self._owner.predicate(item))
        except Exception as exc:  # the user's predicate: whatever it raises is reported with the item's place
            index = self._kept + self._dropped
            raise UnsupportedConfigError(
                f"the predicate {_name(self._owner.predicate)} of a Filtered raised {type(exc).__name__}: {exc} on "
                f"item {index} of its source (a {type(self._owner.source).__name__}, counted from 0 in its order "
                "this epoch); make the predicate return True or False for every item of the source"
            ) from exc

    def position(self) -> dict:
        source = self._source.position() if self._moved else self._start["source"]
        return {"source": plain_copy(source), "kept": self._kept, "dropped": self._dropped}

    def mark(self) -> tuple[int, int]:
        """(source items drawn this epoch, of which kept): noted at each block's end when this filter is the
        outermost source, what ``samples`` names a step's drawn items by."""
        return drawn_kept(self._kept, self._dropped)


def _checked(position: Any) -> dict:
    if (isinstance(position, dict) and set(position) == _POSITION_KEYS
            and all(isinstance(position[key], int) and not isinstance(position[key], bool) and position[key] >= 0
                    for key in ("kept", "dropped"))):
        return position
    raise CheckpointError(
        f"the saved position of a Filtered source is not one it wrote (got {str(position)[:200]}); resume from a "
        "checkpoint written with this source, or start the run without loading"
    )


def _name(predicate: Any) -> str:
    """The predicate as the user wrote it (the same in every process: no address)."""
    function = getattr(predicate, "func", predicate)  # functools.partial
    name = getattr(function, "__qualname__", None) or type(function).__qualname__
    module = getattr(function, "__module__", None)
    return f"{module}.{name}" if module and module != "builtins" else name
