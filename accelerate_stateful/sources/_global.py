"""A global sequence: the one order of items a source produces on every topology.

The package's composable sources (a mixture, a packer, a shuffle buffer) are
global sequences. Item ``k`` is a pure function of the source's settings, its
seed, the epoch, ``k`` and the sources below it; nothing depends on the rank,
the number of ranks or the number of workers. That is what makes them elastic:
a position saved on one topology names the same point of the same sequence on
any other.

A composition (``Packed(Mixture(...))``) reads its children whole through
cursors (:func:`open_source`). Only the outermost source, iterated by a
``DataLoader`` worker, splits the sequence: the items come in blocks of
``b``, dealt to the ``n`` workers in turn, so worker ``w`` keeps the items
``k`` with ``(k // b) % n == w`` and reads the others without keeping them;
every worker's children stay at the sequence's own position. The loader makes
``b`` the items one worker batch takes from the stream (the global batch when
every rank reads the whole stream): worker ``w``'s batches are then the
sequence's batches ``w, w + n, ...``, and the loader, taking the workers'
batches in turn, hands out the batches of a run without workers, whatever
``n`` is. ``b`` is fixed for an epoch and saved with every share's position
(``"block"``; absent: 1, item by item, as before it was recorded). An epoch
resumed on another number of workers or another block starts the blocks again
at the first one no share handed out (``"origin"``: ``loaders/_frontier``). The worker is the
one ``get_worker_info()`` reports, which under a prepared loader is the
*logical* worker (see ``loaders/_stream``), so a share resumed by another
number of workers keeps its items.

State follows torchdata's ``Stateful`` contract: ``state_dict()`` is the
position after the last item handed out (before any, the loaded or the
starting position); ``load_state_dict()`` makes the *next* ``iter()`` start
there; an ``iter()`` with nothing loaded starts the epoch's sequence from its
beginning. States are plain JSON-able data.

Two optional hooks serve a source whose shares must agree on something (a
mixture's weight change): :meth:`GlobalStream.agree`, which the package's
stream loader calls in the main process at the start of every pass with every
share's starting position, and a cursor's ``split(keeps)``, told which items
its share keeps (for accounting what the share delivered).

Items can be left out for good (``loader.skip_samples``: a loss spike's rows):
the loader puts the epoch's ranges of indices into every share's starting
state (``"skip"``), and the outermost source reads the items in them without
handing them to any worker. The split stays the blocks over the indices,
so what every share keeps outside the ranges does not move.
"""

from __future__ import annotations

import array
import bisect
import contextlib
import copy
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence

from torch.utils.data import IterableDataset, get_worker_info

from ..errors import CheckpointError, UnsupportedConfigError
from ._merge import MARK_WIDTH, mark_width, noting_width
from ._recorded import Prefix, recorded
from .indexed import Indexed, as_indexed, stream_library


class Cursor(Protocol):
    """An iterator over a sequence that can say where it is."""

    def __next__(self) -> Any: ...

    def position(self) -> Any:
        """A JSON-able position: opening the sequence there continues right after the last item returned."""

    # Optional: ``split(keeps)``, called once before the first item when the cursor is the outermost one of a
    # worker's share; ``keeps(k)`` says whether the share hands out the item of global index ``k``.


def share_of(k: int, workers: int, block: int = 1, origin: int = 0) -> int:
    """The worker share that hands out the item of global index ``k``: blocks of ``block`` items from index
    ``origin`` on are dealt to the ``workers`` shares in turn."""
    return ((k - origin) // block) % workers


def share_filter(workers: int, worker: int, skip: Sequence[Sequence[int]] = (), block: int = 1, origin: int = 0
                 ) -> Callable[[int], bool]:
    """Whether worker ``worker`` of ``workers`` hands out the item of global index ``k``: the items of its own
    blocks (:func:`share_of`) but those in the sorted, disjoint ``[start, stop)`` ranges of ``skip``."""
    if not skip:
        if block == 1 and origin == 0:
            return lambda k: k % workers == worker
        return lambda k: ((k - origin) // block) % workers == worker
    starts, stops = [start for start, _ in skip], [stop for _, stop in skip]

    def keeps(k: int) -> bool:
        if ((k - origin) // block) % workers != worker:
            return False
        i = bisect.bisect_right(starts, k) - 1
        return i < 0 or k >= stops[i]

    return keeps


@contextlib.contextmanager
def shown_worker_info(info: Any) -> Iterator[None]:
    """Make ``get_worker_info()`` report ``info`` (``None``: no worker) while the block runs.

    torch keeps the worker's ``WorkerInfo`` in one module global; this swaps it and puts it back.
    """
    from torch.utils.data._utils import worker as torch_worker

    outer = torch_worker._worker_info
    torch_worker._worker_info = info
    try:
        yield
    finally:
        torch_worker._worker_info = outer


def hidden_worker_info() -> contextlib.AbstractContextManager:
    """Make ``get_worker_info()`` report no worker while a child source reads.

    A child is read whole by each worker; a ``datasets.IterableDataset`` that
    saw the worker would read only that worker's shards.
    """
    return shown_worker_info(None)


def plain_copy(value: Any) -> Any:
    """A copy of the dicts and lists of a position kept across calls.

    The loader records a dataset's state after every batch; a state that shares a mutable part with the
    previous one is pickled at each record (``loaders/_snapshot``), a fresh one is kept as returned.
    """
    if isinstance(value, dict):
        return {key: plain_copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain_copy(item) for item in value]
    return value


class _IndexCursor:
    """A map-style dataset read in index order; position = the next index."""

    def __init__(self, dataset: Any, position: Optional[int]) -> None:
        self._dataset = dataset
        self._next = int(position or 0)

    def __next__(self) -> Any:
        if self._next >= len(self._dataset):
            raise StopIteration
        item = self._dataset[self._next]
        self._next += 1
        return item

    def position(self) -> int:
        return self._next


class _StatefulCursor:
    """A stateful iterable (``state_dict()``/``load_state_dict()``) read whole; position = its own state."""

    def __init__(self, source: Any, position: Optional[Any], epoch: int) -> None:
        self._source = copy.deepcopy(source)  # a private copy: two cursors of one source never share a state
        _filters_read_by_row(self._source)
        if callable(getattr(self._source, "set_epoch", None)):
            self._source.set_epoch(epoch)
        if position is not None:
            self._source.load_state_dict(copy.deepcopy(position))
        self._items: Optional[Iterator[Any]] = None

    def __next__(self) -> Any:
        with hidden_worker_info():
            if self._items is None:
                self._items = iter(self._source)
            return next(self._items)

    def position(self) -> Any:
        return self._source.state_dict()


def _filters_read_by_row(source: Any) -> None:
    """A ``datasets.IterableDataset`` read through its own state, with a ``filter()`` that reads whole Arrow
    tables (datasets before 5.2, datasets#8359: its state skips the rest of the table): that filter gets its
    input row by row, so the child resumes exactly."""
    if not type(source).__module__.startswith("datasets"):
        return  # datasets is not imported for a source that is not one of its datasets
    from ._hf_filters import rows_one_at_a_time

    rows_one_at_a_time(getattr(source, "_ex_iterable", None))


def check_source(source: Any, named: str = "") -> str:
    """How ``source`` is read (``"global"``, ``"index"`` or ``"stateful"``), or an error naming ``named``.

    The composable sources call it when they are built, so a source they cannot resume exactly is refused in
    the user's script, on every process alike, before any worker reads it.
    """
    if isinstance(source, GlobalStream):
        return "global"
    if stream_library(source) is not None:  # an IterableDataset read by index (its own order would not resume)
        Indexed(source)  # refuses its own shuffle here, when the composition is built
        return "index"
    if not isinstance(source, IterableDataset) and hasattr(source, "__len__") and hasattr(source, "__getitem__"):
        return "index"
    what = f"{named} ({type(source).__name__})" if named else f"a {type(source).__name__}"
    if callable(getattr(source, "state_dict", None)) and callable(getattr(source, "load_state_dict", None)):
        _refuse_shuffle_buffer(source, what)
        return "stateful"
    raise UnsupportedConfigError(
        f"{what} cannot be resumed where it stopped: it has no state_dict() and no index. Give a map-style "
        "dataset (with __len__ and __getitem__), a datasets.Dataset or IterableDataset, or an iterable with "
        "state_dict() and load_state_dict()"
    )


def open_source(source: Any, position: Optional[Any], epoch: int = 0) -> Cursor:
    """A cursor over ``source`` from ``position`` (``None``: its start) in ``epoch``.

    ``source`` is a :class:`GlobalStream`, a map-style dataset (``__len__`` and
    ``__getitem__``: a list, a ``datasets.Dataset``, a torch map-style dataset, a
    mosaicml-streaming or litdata ``StreamingDataset``; read in index order) or a stateful iterable (``state_dict()`` and
    ``load_state_dict()``: a ``datasets.IterableDataset``, a torchdata node).
    """
    kind = check_source(source)
    if kind == "global":
        return source.open(position, epoch)
    if kind == "index":
        return _IndexCursor(as_indexed(source), position)
    return _StatefulCursor(source, position, epoch)


def _refuse_shuffle_buffer(source: Any, what: str) -> None:
    """A ``datasets.IterableDataset`` with a shuffle buffer in its pipeline drops the buffer from its own
    ``state_dict()`` (about ``buffer_size`` items lost at each resume): refused as a child, with the fix."""
    if not type(source).__module__.startswith("datasets"):
        return  # datasets is not imported for a source that is not one of its datasets
    from datasets.iterable_dataset import BufferShuffledExamplesIterable

    pending, last = [getattr(source, "_ex_iterable", None)], True
    while pending:
        node = pending.pop()
        if isinstance(node, BufferShuffledExamplesIterable):
            fix = ("pass exact_shuffle(dataset) instead (accelerate_stateful.sources): the same items in the same "
                   "order, resumed exactly" if last else
                   "make shuffle() its last step and pass exact_shuffle(dataset), or shuffle with "
                   "accelerate_stateful.sources.Shuffled")
            raise UnsupportedConfigError(
                f"{what}: a datasets.IterableDataset with a shuffle buffer (.shuffle(buffer_size=...)) cannot be "
                f"resumed through its own state_dict(), which leaves out what the buffer holds; {fix}"
            )
        last = False
        pending += [child for child in [getattr(node, "ex_iterable", None)] + list(getattr(node, "ex_iterables", ()))
                    if child is not None]


class GlobalStream(IterableDataset):
    """Base of the package's composable sources: a global sequence with a position.

    A subclass implements :meth:`open`: a cursor over its sequence in an epoch
    from a position of its own making, leaving the object itself unchanged (a
    parent opens its children the same way, through :func:`open_source`). The
    base class adds ``set_epoch``, the ``Stateful`` contract and the split
    between ``DataLoader`` workers.
    """

    epoch: int = 0

    def open(self, position: Optional[Any], epoch: int) -> Cursor:  # pragma: no cover - abstract
        """A cursor over this sequence in ``epoch`` from ``position`` (``None``: its start)."""
        raise NotImplementedError

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def agree(self, positions: list) -> tuple[list, list[str]]:
        """Hook: the starting positions of a pass's shares, made to agree with one another.

        The package's stream loader calls it in the main process, on every rank with the same
        ``positions``, at the start of every pass, before dealing the shares to the workers: one entry per
        share (logical worker), each a position of :meth:`open` or ``None`` for the sequence's start. Each
        share then opens at the returned position, in whichever process reads it (persistent workers too),
        so this is the one place where a setting changed in the main process reaches every share, at a
        point of the sequence all shares agree on. Returns the positions and lines to log (once, on the
        main process) saying what changed. A parent source delegates to its children. The default changes
        nothing.
        """
        return positions, []

    def settings(self) -> dict[str, Any]:
        """Hook: what defines this sequence besides its children (weights, sizes, seeds), as plain values.

        Every process must hold the same: the loader compares them across processes when a checkpoint is taken
        or loaded (``DataLoaderAdapter._data_digest``). A parent also lists its children in :meth:`children`.
        """
        return {}

    def children(self) -> dict[str, Any]:
        """Hook: the sources this one reads, by name (none by default)."""
        return {}

    def check_position(self, position: Any) -> None:
        """Hook: raise :class:`CheckpointError` (naming this source and the fix) unless this source can continue
        from ``position``, a position of :meth:`open` (not ``None``); changes nothing.

        :meth:`load_state_dict` calls it before anything changes, so a damaged or foreign position is refused in
        one place per source, at the load; a parent checks its children's positions with :func:`check_child`.
        """

    # ------------------------------------------------------------------ Stateful
    def state_dict(self) -> dict:
        return self._state(recording=False)

    def recorded_state(self) -> dict:
        """:meth:`state_dict` as the loader records it after every batch: parts that cost to put in JSON-able
        form may be kept in a cheap one until read (``_recorded``; ``settled()`` of it is ``state_dict()``)."""
        return self._state(recording=True)

    def _state(self, recording: bool) -> dict:
        live = self.__dict__.get("_live")
        if live is not None:
            cursor, index, skip, block, origin, marks, width = live
            state = {"index": index[0], "position": recorded(cursor) if recording else cursor.position()}
            if skip:
                state["skip"] = [list(r) for r in skip]
            if block != 1:
                state["block"] = block
            if origin:
                state["origin"] = origin
            if marks is not None:
                state["marks"] = Prefix(marks, len(marks)) if recording else marks.tolist()
                if width != MARK_WIDTH:
                    state["mark_width"] = width
            return state
        start = self.__dict__.get("_start")
        return copy.deepcopy(start) if start is not None else {"index": 0, "position": None}

    def load_state_dict(self, state: dict) -> None:
        if not _well_formed(state):
            raise CheckpointError(
                f"the saved position of a {type(self).__name__} is not one it wrote (got {str(state)[:200]}); "
                "resume from a checkpoint written with this source, or start the run without loading"
            )
        if state["position"] is not None:
            self.check_position(state["position"])
        self._start = copy.deepcopy(state)
        self._live = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if state.get("_live") is not None:  # a live cursor does not travel: its position does
            state["_start"], state["_live"] = self.state_dict(), None
        return state

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[Any]:
        start = self.__dict__.get("_start") or {"index": 0, "position": None}
        self._start = None
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        skip = [tuple(r) for r in start.get("skip", ())]
        block, origin = start.get("block", 1), start.get("origin", 0)
        keeps = share_filter(workers, worker, skip, block, origin)
        cursor = self.open(start["position"], self.epoch)
        if callable(getattr(cursor, "split", None)):
            cursor.split(keeps)
        index = [start["index"]]  # shared with state_dict(): the global index of the next item
        mark = getattr(cursor, "mark", None)
        # Noted where the loader asks (``"marks"`` in the starting state): per block of a worker batch there, where
        # item by item (a source iterated on its own) the log would grow with every item.
        marks = array.array("q", start["marks"]) if callable(mark) and "marks" in start else None
        width = MARK_WIDTH if marks is None else noting_width(start, mark())
        self._live = (cursor, index, skip, block, origin, marks, width)
        if marks is None:
            return self._split(cursor, index, keeps)
        ends = share_filter(workers, worker, (), block, origin)  # this share's blocks, items left out or not
        return self._split_marked(cursor, index, keeps, lambda k: (k + 1 - origin) % block == 0 and ends(k),
                                  mark, marks, width)

    @staticmethod
    def _split(cursor: Cursor, index: list, keeps: Callable[[int], bool]) -> Iterator[Any]:
        while True:
            try:
                item = next(cursor)
            except StopIteration:
                return
            index[0] += 1
            if keeps(index[0] - 1):
                yield item

    @staticmethod
    def _split_marked(cursor: Cursor, index: list, keeps: Callable[[int], bool], ends: Callable[[int], bool],
                      mark: Callable[[], Any], marks: array.array, width: int) -> Iterator[Any]:
        """:meth:`_split`, noting after the last item of each of this share's blocks (``ends``) where the sequence
        stands (the cursor's ``mark()``) as ``(index, *mark)`` in ``marks``, ``width`` ints in all
        (``_merge.noting_width``), before the item is handed out: the batch it ends is recorded with it."""
        while True:
            try:
                item = next(cursor)
            except StopIteration:
                return
            k = index[0]
            index[0] = k + 1
            if ends(k):
                at = mark()
                if at is not None:
                    marks.extend((k + 1, *at[:width - 1]))
            if keeps(k):
                yield item


# What GlobalStream.state_dict() writes. ``marks``: where the sequence stood at the end of each of the share's
# blocks this epoch, ``(index, *mark)`` flattened, for an outermost source whose cursor has ``mark()`` (a
# ``Packed``: the next token as (document, offset), and over a ``Filtered`` the filter's items drawn; a
# ``Filtered``: the source items drawn and kept); ``mark_width``: the ints each takes, where not 3. ``samples``
# names a step's rows from them (``_merge.mark_tuples``).
STATE_KEYS = frozenset({"index", "position", "skip", "block", "origin", "marks", "mark_width"})


def _well_formed(state: Any) -> bool:
    """A state :meth:`GlobalStream.state_dict` writes: the next index, a position, maybe the ranges left out and
    the epoch's block."""
    if not isinstance(state, dict) or not {"index", "position"} <= set(state) <= STATE_KEYS:
        return False
    if not all(isinstance(state.get(key, 1), int) and not isinstance(state.get(key, 1), bool)
               for key in ("index", "block", "origin")) or state["index"] < 0 or state.get("block", 1) < 1 \
            or not 0 <= state.get("origin", 0) <= state["index"]:
        return False
    marks, width = state.get("marks", []), mark_width(state)
    if isinstance(width, bool) or not isinstance(width, int) or width < 2:
        return False
    if not isinstance(marks, list) or len(marks) % width or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in marks):
        return False
    skip = state.get("skip", [])
    return isinstance(skip, list) and all(
        isinstance(r, (list, tuple)) and len(r) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in r)
        and 0 <= r[0] < r[1] for r in skip
    ) and all(a[1] <= b[0] for a, b in zip(skip, skip[1:]))


def agree_states(dataset: Any, states: list) -> tuple[list, list[str]]:
    """:meth:`GlobalStream.agree` on the shares' ``state_dict()`` values (``None``: a share's start)."""
    positions = [None if state is None else state["position"] for state in states]
    agreed, lines = dataset.agree(positions)
    found = [
        state if state is None and position is None else dict(state or {"index": 0}, position=position)
        for state, position in zip(states, agreed)
    ]
    return found, lines


def data_settings(dataset: Any, named: str = "") -> list[tuple[str, str, Any]]:
    """``(where, setting, value)`` for every setting of ``dataset`` and the sources below it that defines the data
    (:meth:`GlobalStream.settings`); nothing for a dataset that is not a composable source."""
    if not isinstance(dataset, GlobalStream):
        return []
    where = named or type(dataset).__name__
    found = [(where, key, value) for key, value in sorted(dataset.settings().items())]
    for name, child in dataset.children().items():
        found += data_settings(child, f"{where}'s {name} ({type(child).__name__})")
    return found


def check_child(source: Any, position: Any) -> None:
    """:meth:`GlobalStream.check_position` of a child source's saved position (other sources check their own
    when opened)."""
    if position is None:
        return
    if isinstance(source, GlobalStream):
        source.check_position(position)
        return
    source = as_indexed(source)
    if check_source(source) == "index" and (isinstance(position, bool) or not isinstance(position, int)
                                             or not 0 <= position <= len(source)):
        raise CheckpointError(
            f"the saved position of a {type(source).__name__} of {len(source)} items read in index order is "
            f"{position!r}, not an index from 0 to {len(source)}; resume from a checkpoint written with this data, "
            "or start the run without loading"
        )
