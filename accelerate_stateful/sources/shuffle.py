"""Shuffle buffers whose position is what the buffer holds, as places in the source to read again.

A shuffle buffer's state is its content. Saving the items themselves makes a
checkpoint as large as the buffer's data; dropping them (🤗 ``datasets``) loses
about ``buffer_size`` items at every resume. Here the position names each
buffered item by its place in the source (the number of items read before it)
and keeps the source's position from before the oldest of them: a resume opens
the source there and reads it again up to where the buffer had read, keeping the
buffered items in their slots. Nothing is lost or repeated, the state holds
integers only, and what a resume reads again is bounded by how long an item can
stay in the buffer, not by how far the run got.
"""

from __future__ import annotations

import array
import collections
from typing import Any, Optional

from ..errors import CheckpointError, UnsupportedConfigError
from ._draws import Anchor, Draws, Replayed
from ._global import Cursor, GlobalStream, check_child, check_source, open_source, plain_copy
from ._recorded import IntsAsTuple

_POSITION_KEYS = {"from", "from_read", "read", "slots", "draws", "ended"}
# Recorded for ``accelerate-stateful samples`` (which replays the draws) and never read by a resume, so a
# position written before them still resumes.
_RECORDED = {"seed", "buffer_size", "to"}


class Shuffled(GlobalStream):
    """A shuffle buffer over a source, resumed exactly by reading a bounded stretch of the source again.

    The buffer fills with the first ``buffer_size`` items; then each step draws
    a slot at random, hands out its item and puts the source's next item in
    that slot. Once the source ends, the buffer empties in random order. Draw
    ``t`` depends on ``(seed, epoch, t)`` only (:class:`Draws`), never on a
    global RNG, so item ``k`` of the shuffled sequence is a pure function of the
    source's sequence, the seed and the epoch: resumed on any number of
    processes or workers, the sequence goes on.

    Args:
        source: What to shuffle: a map-style dataset, a ``datasets.Dataset`` or
            ``IterableDataset``, a stateful iterable or another of this
            package's sources (a ``Mixture`` of documents, say).
        buffer_size: Items held, at least 1 (1: the source's order).
        seed: A non-negative int, the same on every rank; another seed gives
            another order. The epoch (``set_epoch``) changes the order too.

    Position (the ``"position"`` of ``state_dict()``): ``from`` (the source's
    position before ``from_read`` items were read), ``read`` (items read from
    the source so far), ``slots`` (for each buffer slot, the number of items
    read before its item: ``buffer_size`` integers, a tuple), ``draws`` (draws made so
    far), ``ended`` (whether the source has ended), and, for ``accelerate-stateful samples`` only,
    ``seed``, ``buffer_size`` and ``to`` (the source's position after ``read`` items). A resume opens the source
    at ``from`` and reads ``read - from_read`` items again, keeping those named
    in ``slots``. ``from`` is refreshed every ``buffer_size / 16`` reads to the
    latest it may be, so ``read - from_read`` is the age of the oldest buffered
    item plus at most ``buffer_size / 8``: about ``buffer_size * (ln(buffer_size) + 1)``
    (measured in ``docs/sources/shuffle.md``).

    Examples:
        >>> order = list(Shuffled(range(10), buffer_size=4, seed=0))
        >>> sorted(order) == list(range(10))
        True
    """

    def __init__(self, source: Any, buffer_size: int, *, seed: int = 0) -> None:
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
            raise UnsupportedConfigError(
                f"Shuffled(buffer_size={buffer_size!r}): the buffer must hold at least one item; pass an int >= 1"
            )
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise UnsupportedConfigError(
                f"Shuffled(seed={seed!r}): the seed must be an int >= 0, the same on every rank"
            )
        check_source(source, "Shuffled's source")
        self.source, self.buffer_size, self.seed = source, buffer_size, seed

    def settings(self) -> dict[str, Any]:
        return {"buffer_size": self.buffer_size, "seed": self.seed}

    def children(self) -> dict[str, Any]:
        return {"source": self.source}

    def check_position(self, position: Any) -> None:
        found = _checked(position, self.buffer_size)
        self._check_seed(found)
        for key in ("from", "to"):
            if key in found:
                check_child(self.source, found[key])

    def open(self, position: Optional[Any], epoch: int) -> Cursor:
        found = _checked(position, self.buffer_size)
        self._check_seed(found)
        return _BufferCursor(self, epoch, found)

    def _check_seed(self, position: Optional[dict]) -> None:
        saved = self.seed if position is None else position.get("seed", self.seed)  # (recorded since `samples`)
        if saved != self.seed:
            raise CheckpointError(
                f"the checkpoint's Shuffled buffer drew with seed={saved!r}, this one draws with seed={self.seed}, so "
                f"every sample after the resume would come out in another order; resume with Shuffled(..., "
                f"seed={saved!r}), or start a fresh run"
            )


    def agree(self, positions: list) -> tuple[list, list[str]]:
        """Passed on to the source when it is a global sequence (``GlobalStream.agree``), for a fresh pass.

        A resumed buffer reads its source again from before its oldest item, and must read the same items
        it read then: a change below it (a mixture's new weights) cannot take effect there without
        changing what the buffer held, so it is refused.
        """
        if not isinstance(self.source, GlobalStream):
            return positions, []
        if all(position is None for position in positions):  # a fresh pass: the buffer starts empty
            below, lines = self.source.agree(list(positions))
            fresh = {"from_read": 0, "read": 0, "slots": (), "draws": 0, "ended": False}
            return [None if child is None else dict(fresh, **{"from": child}) for child in below], lines
        below, lines = self.source.agree([None if p is None else p["from"] for p in positions])
        if lines:
            raise UnsupportedConfigError(
                f"cannot resume a Shuffled over a {type(self.source).__name__} with this change ("
                + "; ".join(lines) + "): the buffer reads its source again from before its oldest item and "
                "must find the items it held. Resume with the saved settings, and change them at the start of "
                "an epoch, or shuffle each source below the mixture (Mixture({name: Shuffled(source, ...)}))"
            )
        agreed = [None if p is None else dict(p, **{"from": child}) for p, child in zip(positions, below)]
        return agreed, lines


class _BufferCursor:
    """The buffer: items in slots, each slot's read number, and positions of the source to read again from."""

    def __init__(self, owner: Shuffled, epoch: int, saved: Optional[dict]) -> None:
        self._size, self._seed, self._epoch = owner.buffer_size, owner.seed, epoch
        self._every = max(1, owner.buffer_size // 16)  # reads between two source positions kept
        self._draw = Draws(owner.seed, epoch)
        start = saved or {"from": None, "from_read": 0, "read": 0, "slots": [], "draws": 0, "ended": False}
        self._source = open_source(owner.source, start["from"], epoch)
        self._marks = collections.deque([(start["from_read"], start["from"])])  # (read, position) oldest first
        self._read, self._draws, self._ended = start["from_read"], start["draws"], start["ended"]
        self._slots = array.array("q", start["slots"])  # machine ints: an anchor copies them at memory speed
        self._anchor: Optional[Anchor] = None  # the full buffer's slots that records replay the draws from
        self._items: list = [None] * len(self._slots)
        # Items held per stretch of ``_every`` reads (read number // _every), and the first stretch that may hold
        # one: where the oldest held item is, without scanning the slots.
        self._held: collections.defaultdict = collections.defaultdict(int)
        for number in self._slots:
            self._held[number // self._every] += 1
        self._low = self._read // self._every
        self._refill(start["read"])

    def _refill(self, read: int) -> None:
        wanted = {number: slot for slot, number in enumerate(self._slots)}
        if len(wanted) != len(self._slots) or not all(self._read <= number < read for number in wanted):
            raise CheckpointError(
                f"the saved buffer of a Shuffled names items outside the stretch it says to read again ({self._read} "
                f"to {read}); the checkpoint is damaged: resume from another one, or start without loading"
            )
        while self._read < read:
            number = self._read
            try:
                item = next(self._source)
            except StopIteration:
                raise CheckpointError(
                    f"the source of a Shuffled ended after {number} items, where the saved buffer had read {read}; "
                    "resume with the source the checkpoint was written with, or start the run without loading"
                ) from None
            self._read += 1
            if number in wanted:
                self._items[wanted[number]] = item

    def _next_item(self) -> Any:
        """The source's next item, keeping a position of the source every ``_every`` reads."""
        if self._read % self._every == 0 and self._marks[-1][0] < self._read:
            oldest = self._oldest()
            while len(self._marks) > 1 and self._marks[1][0] <= oldest:
                self._marks.popleft()
            self._marks.append((self._read, self._source.position()))
        item = next(self._source)
        self._read += 1
        return item

    def __next__(self) -> Any:
        while not self._ended and len(self._items) < self._size:
            try:
                item = self._next_item()
            except StopIteration:
                self._ended = True
                break
            self._items.append(item)
            self._slots.append(self._read - 1)
            self._held[(self._read - 1) // self._every] += 1
        if not self._items:
            raise StopIteration
        slot = self._draw(self._draws) % len(self._items)
        self._draws += 1
        out, gone = self._items[slot], self._slots[slot]
        if not self._ended:
            try:
                self._items[slot] = self._next_item()
                self._slots[slot] = self._read - 1
                self._held[gone // self._every] -= 1
                self._held[(self._read - 1) // self._every] += 1
                return out
            except StopIteration:
                self._ended = True
        self._held[gone // self._every] -= 1
        self._items[slot], self._slots[slot] = self._items[-1], self._slots[-1]
        self._items.pop()
        self._slots.pop()
        return out

    def _oldest(self) -> int:
        """The first read number of the stretch of ``_every`` reads holding the oldest item in the buffer (all
        items read so far when it is empty). Marks are kept at multiples of ``_every``, so which of them lie at
        or before it is what lies at or before the oldest item itself: ``min(self._slots)``, without the scan.
        The item being handed out still counts (it leaves once its slot is refilled)."""
        held, low = self._held, self._low
        while low * self._every < self._read and not held.get(low):
            held.pop(low, None)
            low += 1
        self._low = low
        return min(low * self._every, self._read)

    def position(self) -> dict:
        return self._position(tuple(self._slots))

    def recorded(self) -> dict:
        """:meth:`position` after a batch, its slots made a tuple only when read (``_recorded``).

        While the buffer is full and its source goes on, the record holds the draw count and an anchor, a copy of
        the slots taken at most once per ``buffer_size`` draws (``_draws.Replayed``): a copy per batch cost each
        worker 8 to 9 page faults a batch, and cache misses in the reading (``docs/benchmarks.md``). Otherwise it
        holds a copy.
        """
        if self._ended or len(self._slots) != self._size:
            return self._position(IntsAsTuple(self._slots[:]))
        if self._anchor is None or not self._anchor.serves(self._draws, self._read):
            self._anchor = Anchor(self._slots[:], self._draws, self._read, self._seed, self._epoch)
        return self._position(Replayed(self._anchor, self._draws))

    def _position(self, slots: Any) -> dict:
        read, position = self._marks[0]
        return {"from": plain_copy(position), "from_read": read, "read": self._read, "slots": slots,
                "draws": self._draws, "ended": self._ended, "seed": self._seed, "buffer_size": self._size,
                "to": plain_copy(self._source.position())}


def _checked(position: Optional[Any], size: int) -> Optional[dict]:
    if position is None:
        return None
    recorded = set(position) - _POSITION_KEYS if isinstance(position, dict) else set()
    if (isinstance(position, dict) and _POSITION_KEYS <= set(position) and recorded in (set(), _RECORDED)
            and (not recorded or (_whole(position["seed"]) and position["buffer_size"] == size))
            and isinstance(position["slots"], (list, tuple)) and len(position["slots"]) <= size
            and all(_whole(n) for n in position["slots"])
            and isinstance(position["ended"], bool)
            and all(_whole(position[key]) for key in ("from_read", "read", "draws"))):
        return position
    raise CheckpointError(
        f"the saved position of a Shuffled source is not one it wrote with buffer_size={size} (got "
        f"{str(position)[:200]}); resume with the buffer_size the checkpoint was written with, or start without loading"
    )


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def exact_shuffle(dataset: Any) -> GlobalStream:
    """A shuffled 🤗 ``datasets.IterableDataset`` in its own order, item for item, that resumes exactly.

    ``dataset`` ends with ``.shuffle(seed=..., buffer_size=...)``. Iterated,
    the result gives the items stock ``for x in dataset`` gives, in the same
    order, in every epoch (``set_epoch`` reshuffles the shards and the buffer as
    ``datasets`` does). Unlike the dataset's own ``state_dict()``, which drops
    the buffer (about ``buffer_size`` items lost at each resume), its position
    names the rows the buffer held when it was last permuted by the number of
    rows read before each, with the generator's state before that permutation
    and the input's state from before the oldest of those rows; a resume reads
    that stretch of the input again (measured in ``docs/sources/shuffle.md``).

    The result is one of this package's sources: read by ``DataLoader``
    workers, each reads the whole stream and keeps its share, so it resumes on
    any number of processes and workers; and it composes (``Packed(exact_shuffle(ds), ...)``).

    Raises:
        UnsupportedConfigError: ``dataset`` is not a ``datasets.IterableDataset``
            whose last step is ``shuffle()``, or it has ``with_format()`` or
            ``split_dataset_by_node()`` (the loader splits the stream itself).

    Examples:
        >>> ds = load_dataset("json", data_files=files, split="train", streaming=True)  # doctest: +SKIP
        >>> stream = exact_shuffle(ds.shuffle(seed=42, buffer_size=10_000))  # doctest: +SKIP
        >>> list(stream) == list(ds.shuffle(seed=42, buffer_size=10_000))  # doctest: +SKIP
        True
    """
    from ._shuffle_hf import HFShuffled

    return HFShuffled(dataset)
