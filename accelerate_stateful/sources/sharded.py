"""Logical shards: a stream cut into a fixed number of parts, each with its own resumable position.

A source takes part by implementing :class:`ShardedSource`: how many parts it
has, and how to open part ``i`` at a saved position; the reader it returns
reports its position at any moment. The loader reads the parts through a
:class:`LogicalShardStream`: reader ``g`` of ``R = world_size * num_workers``
(rank ``r``, worker ``w``: ``g = r * num_workers + w``) owns the parts
``i % R == g`` and interleaves them one item at a time. Its state is the
position of each part it owns, so a checkpoint can be resumed on another
number of ranks or workers: the parts are dealt out again, each continuing
from its own position, and nothing already delivered is read again.

Two sources ship with the package: :class:`TextLines` (lines of local text
files, one part per file, position = byte offset) and :class:`HFShards` (the
shards of a local ``datasets.IterableDataset``, position = the shard's own
``state_dict()``).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Iterator, Optional, Protocol, Sequence, runtime_checkable

from torch.utils.data import IterableDataset, get_worker_info

from ._merge import merge_positions


class ShardReader(Protocol):
    """An iterator over one part that can say where it is."""

    def __iter__(self) -> Iterator[Any]: ...

    def __next__(self) -> Any: ...

    def position(self) -> Any:
        """A JSON-able position: opening the part there continues right after the last item returned."""


@runtime_checkable
class ShardedSource(Protocol):
    """The protocol a source implements to be read as logical shards (elastic across ranks and workers)."""

    def num_shards(self) -> int:
        """How many parts the source has; fixed for the whole run."""

    def open_shard(self, index: int, position: Optional[Any]) -> ShardReader:
        """A reader of part ``index`` starting at ``position`` (``None``: its start), reading nothing before it."""


class _LineReader:
    def __init__(self, path: Path, offset: int) -> None:
        self._file = open(path, "rb")
        self._file.seek(offset)
        self._offset = offset

    def __iter__(self) -> "_LineReader":
        return self

    def __next__(self) -> str:
        line = self._file.readline()
        if not line:
            self._file.close()
            raise StopIteration
        self._offset += len(line)
        return line.decode("utf-8").rstrip("\n")

    def position(self) -> int:
        return self._offset


class TextLines(IterableDataset):
    """Lines of local text files; one logical shard per file, position = byte offset.

    Examples:
        >>> dl = DataLoader(TextLines(sorted(Path("corpus").glob("*.txt"))), batch_size=32, num_workers=2)
        ... # doctest: +SKIP
    """

    def __init__(self, paths: Sequence[Any]) -> None:
        self.paths = [Path(p) for p in paths]
        if not self.paths:
            raise ValueError("TextLines needs at least one file")

    def num_shards(self) -> int:
        return len(self.paths)

    def open_shard(self, index: int, position: Optional[Any]) -> _LineReader:
        return _LineReader(self.paths[index], int(position or 0))

    def __iter__(self) -> Iterator[str]:
        """Plain iteration (outside a prepared loader): every file in turn, split across workers by file."""
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for index in range(worker, len(self.paths), workers):
            yield from self.open_shard(index, None)


class _HFShardReader:
    def __init__(self, shard: Any) -> None:
        self._shard = shard
        self._items = iter(shard)

    def __iter__(self) -> "_HFShardReader":
        return self

    def __next__(self) -> Any:
        return next(self._items)

    def position(self) -> Any:
        return self._shard.state_dict()


class HFShards(IterableDataset):
    """The shards of a local ``datasets.IterableDataset`` as logical shards (``n_shards`` of them)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def num_shards(self) -> int:
        return self.dataset.n_shards

    def open_shard(self, index: int, position: Optional[Any]) -> _HFShardReader:
        shard = self.dataset.shard(num_shards=self.dataset.n_shards, index=index, contiguous=True)
        shard.set_epoch(self.dataset.epoch)  # a shard starts at epoch 0: a shuffled stream reshuffles by epoch
        if position is not None:
            shard.load_state_dict(copy.deepcopy(position))
        return _HFShardReader(shard)

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.dataset)


class LogicalShardStream(IterableDataset):
    """One reader's share of a :class:`ShardedSource`: the parts it owns, interleaved, with their positions.

    State dict:
        positions: ``{part index (str): position}`` of the parts this reader has opened.
        done: the parts it finished.
        next: the part it reads from next (``None``: its first unfinished one).
    """

    def __init__(self, source: ShardedSource, world_size: int, rank: int) -> None:
        self.source, self.world_size, self.rank = source, world_size, rank
        self.num_shards = source.num_shards()
        self._positions: dict[int, Any] = {}
        self._done: set[int] = set()
        self._next: Optional[int] = None
        self._readers: dict[int, ShardReader] = {}

    def owned(self) -> list[int]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        readers, reader = self.world_size * workers, self.rank * workers + worker
        return [i for i in range(self.num_shards) if i % readers == reader]

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.source, "set_epoch"):
            self.source.set_epoch(epoch)

    def state_dict(self) -> dict:
        positions = dict(self._positions)
        positions.update({i: reader.position() for i, reader in self._readers.items()})
        return {"positions": {str(i): p for i, p in positions.items()}, "done": sorted(self._done),
                "next": self._next}

    def load_state_dict(self, state: dict) -> None:
        """Take the positions of the parts this reader owns (a merged state holds every part's)."""
        owned = set(self.owned())
        self._positions = {int(i): p for i, p in state["positions"].items() if int(i) in owned}
        self._done = {i for i in state["done"] if i in owned}
        self._next = state["next"] if state["next"] in owned else None
        self._readers = {}

    def __iter__(self) -> Iterator[Any]:
        active = [i for i in self.owned() if i not in self._done]
        at = active.index(self._next) if self._next in active else 0
        while active:
            index = active[at % len(active)]
            reader = self._readers.get(index)
            if reader is None:
                reader = self._readers[index] = self.source.open_shard(index, self._positions.get(index))
            try:
                item = next(reader)
            except StopIteration:
                self._positions[index] = self._readers.pop(index).position()
                self._done.add(index)
                active.remove(index)
                self._next = active[at % len(active)] if active else None
                continue
            at = (at % len(active)) + 1
            self._next = active[at % len(active)]
            yield item

