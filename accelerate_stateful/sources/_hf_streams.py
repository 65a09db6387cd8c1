"""🤗 ``datasets`` streams as users write them (``ds.shuffle(...).map(...)``, interleaved, filtered), resumed exactly.

A ``datasets.IterableDataset`` saves its position in its own ``state_dict()``, which leaves out what a
shuffle buffer holds: a resume inside a buffer loses (and, over Arrow data, repeats) up to ``buffer_size``
items. The loader recognises such a dataset when it is prepared (:func:`exact_stream`) and reads it through
:class:`HFStream`: the same pipeline, item for item, with each shuffle buffer replaced by ``exact_shuffle``'s
cursor (``_shuffle_hf``), whose position names the rows the buffer holds. Every other step (``map``,
``filter``, ``take``, ``skip``, ``interleave_datasets``) is ``datasets``' own and resumes from its own state,
now taken above a buffer that resumes exactly. The decision depends on the dataset object alone, which every
process builds the same way, so every process decides the same.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any, Optional

from datasets import IterableDataset as HFIterable
from datasets.iterable_dataset import BufferShuffledExamplesIterable, _BaseExamplesIterable

from ..errors import CheckpointError, UnsupportedConfigError
from ._global import Cursor, GlobalStream, hidden_worker_info
from ._hf_filters import children as _children, rows_one_at_a_time, table_filters as _table_filters
from ._shuffle_hf import _HFCursor, _Pipeline, _version, plays_rounds

_KEY = "exact_shuffle"  # the buffer's position inside datasets' own state tree


def exact_stream(dataset: Any) -> Any:
    """What the loader reads for ``dataset``: an :class:`HFStream` for a ``datasets.IterableDataset`` with a
    shuffle buffer or a table-reading ``filter()`` anywhere in its pipeline, else ``dataset`` itself (its own
    state resumes it exactly).

    Raises:
        UnsupportedConfigError: the pipeline has a shuffle buffer that cannot be replayed exactly (see
            :class:`HFStream`).
    """
    if not isinstance(dataset, HFIterable) or not (_buffers(dataset._ex_iterable)
                                                   or _table_filters(dataset._ex_iterable)):
        return dataset
    return HFStream(dataset)


class HFStream(GlobalStream):
    """A ``datasets.IterableDataset`` whose shuffle buffers resume exactly, in ``datasets``' own order.

    Read by ``DataLoader`` workers, each reads the whole stream and keeps its share (a global sequence), so
    the steps of the pipeline run in every worker: with ``num_workers=n`` a ``map`` runs ``n`` times per item.

    Position: ``dataset`` (``datasets``' own state tree, each buffer's entry being ``exact_shuffle``'s
    position) and ``generators`` (a digest of the buffers' generators, so that a run whose shuffle draws
    another order, e.g. ``shuffle()`` without a ``seed``, is refused instead of resumed elsewhere).

    Examples:
        >>> stream = HFStream(ds.shuffle(seed=42, buffer_size=1000).map(tokenize))  # doctest: +SKIP
    """

    def __init__(self, dataset: HFIterable) -> None:
        _refuse_what_cannot_be_replayed(dataset)
        self.dataset = dataset
        self._generators = _digest(dataset._ex_iterable)

    def settings(self) -> dict[str, Any]:
        return {"shuffle generators": self._generators}

    def check_position(self, position: Any) -> None:
        if not (isinstance(position, dict) and set(position) == {"generators", "dataset"}
                and isinstance(position["dataset"], dict)):
            raise CheckpointError(
                f"the saved position of a shuffled datasets.IterableDataset is not one this package wrote (got "
                f"{str(position)[:200]}); resume from a checkpoint written with this dataset, or start without loading"
            )
        if position["generators"] != self._generators:
            raise CheckpointError(
                "cannot resume the shuffled datasets.IterableDataset: its shuffle draws another order than the run "
                "that saved this checkpoint, so the buffer it held cannot be found again; pass the same "
                "seed=... to shuffle() (and interleave_datasets()) as that run (a shuffle without a seed draws a "
                "new order in every process), or start without loading"
            )

    def open(self, position: Optional[Any], epoch: int) -> Cursor:
        return _StreamCursor(self, position, epoch)


class _StreamCursor:
    """Stock iteration of a copy of the dataset whose buffers are exact, read as one reader."""

    def __init__(self, owner: HFStream, position: Optional[dict], epoch: int) -> None:
        twin = copy.copy(owner.dataset)
        twin._ex_iterable = _with_exact_buffers(copy.deepcopy(owner.dataset._ex_iterable))
        twin._epoch, twin._starting_state_dict, twin._state_dict = int(epoch), None, None
        if position is not None:
            twin.load_state_dict(copy.deepcopy(position["dataset"]))
        self._twin, self._items, self._start, self._digest = twin, None, position, owner._generators

    def __next__(self) -> Any:
        with hidden_worker_info():  # a datasets iterable that saw a DataLoader worker would read its share
            if self._items is None:
                self._items = iter(self._twin)
            return next(self._items)

    def position(self) -> Optional[dict]:
        if self._items is None:
            return copy.deepcopy(self._start)
        return {"generators": self._digest, "dataset": self._twin.state_dict()}


class _Live:
    """A buffer's position, read when ``datasets`` copies its state tree (at a save, or a batched map's start)."""

    def __init__(self, cursor: _HFCursor) -> None:
        self.cursor = cursor

    def __deepcopy__(self, memo: dict) -> Optional[dict]:
        return self.cursor.position()


class _ExactBuffer(_BaseExamplesIterable):
    """``BufferShuffledExamplesIterable`` in ``datasets``' own tree, played by ``exact_shuffle``'s cursor."""

    def __init__(self, buffer: BufferShuffledExamplesIterable) -> None:
        super().__init__()
        self.buffer = buffer

    @property
    def ex_iterable(self) -> Any:  # datasets walks ``ex_iterable`` to shift the generators below (epochs)
        return self.buffer.ex_iterable

    @ex_iterable.setter
    def ex_iterable(self, node: Any) -> None:
        self.buffer.ex_iterable = node

    @property
    def is_typed(self) -> bool:
        return self.buffer.is_typed

    @property
    def features(self) -> Any:
        return self.buffer.features

    @property
    def num_shards(self) -> int:
        return self.buffer.num_shards

    def shuffle_data_sources(self, generator: Any) -> "_ExactBuffer":
        return _ExactBuffer(self.buffer.shuffle_data_sources(generator))

    def shift_rngs(self, value: int) -> "_ExactBuffer":
        return _ExactBuffer(self.buffer.shift_rngs(value))

    def shard_data_sources(self, num_shards: int, index: int, contiguous: bool = True) -> "_ExactBuffer":
        return _ExactBuffer(self.buffer.shard_data_sources(num_shards, index, contiguous=contiguous))

    def _init_state_dict(self) -> dict:
        self.buffer.ex_iterable._init_state_dict()
        self._state_dict = {_KEY: None, "type": "ExactShuffleBuffer"}
        return self._state_dict

    def __iter__(self) -> Any:
        saved = self._state_dict.get(_KEY) if self._state_dict else None
        cursor = _HFCursor(_Pipeline(self.buffer, None), None if isinstance(saved, _Live) else saved)
        if self._state_dict is not None:
            self._state_dict[_KEY] = _Live(cursor)
        number = 0
        while True:
            try:
                item = next(cursor)
            except StopIteration:
                return
            number += 1
            yield f"exact_shuffle_{number}", item


def _buffers(node: Any) -> list:
    """The shuffle buffers of a pipeline, top first."""
    found = [node] if isinstance(node, BufferShuffledExamplesIterable) else []
    for child in _children(node):
        found += _buffers(child)
    return found


def _with_exact_buffers(node: Any) -> Any:
    """``node`` (a private copy) with every shuffle buffer, at any depth, played by an :class:`_ExactBuffer`, and
    every table-reading filter given its input one row at a time (the upstream fix of datasets#8359)."""
    rows_one_at_a_time(node)
    return _exact_buffers(node)


def _exact_buffers(node: Any) -> Any:
    if hasattr(node, "ex_iterables"):
        node.ex_iterables = [_exact_buffers(child) for child in node.ex_iterables]
    elif getattr(node, "ex_iterable", None) is not None:
        node.ex_iterable = _exact_buffers(node.ex_iterable)
    return _ExactBuffer(node) if isinstance(node, BufferShuffledExamplesIterable) else node


def _generators(node: Any) -> list:
    """The states of the generators in a pipeline (shuffle buffers, ``interleave_datasets``' draws), top first."""
    generator = getattr(node, "generator", None)
    found = [generator.bit_generator.state] if generator is not None else []
    for child in _children(node):
        found += _generators(child)
    return found


def _digest(node: Any) -> str:
    """The pipeline's generators: the same for a dataset built the same way with its seeds."""
    drawn = _generators(node)
    return hashlib.sha256(json.dumps(drawn, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _refuse_what_cannot_be_replayed(dataset: HFIterable) -> None:
    if not plays_rounds(BufferShuffledExamplesIterable):
        raise UnsupportedConfigError(
            f"this datasets.IterableDataset has a shuffle buffer (.shuffle(buffer_size=...)), whose position "
            f"datasets {_version()} does not save and this package replays only for releases that permute the "
            "buffer in rounds (5.2.0 does); upgrade datasets, or shuffle with "
            "accelerate_stateful.sources.Shuffled(dataset_without_shuffle, buffer_size, seed=...)"
        )
    if dataset._distributed is not None:
        raise UnsupportedConfigError(
            "this datasets.IterableDataset has a shuffle buffer (.shuffle(buffer_size=...)) and was split with "
            "split_dataset_by_node(); the loader can resume the buffer exactly only when it splits the stream "
            "itself: pass the dataset without split_dataset_by_node() (Accelerate's prepare splits it between "
            "processes as split_dataset_by_node would)"
        )
    pending = [dataset._ex_iterable]
    while pending:
        node = pending.pop()
        formatting = getattr(node, "formatting", None)
        if formatting is not None and formatting.is_table and _buffers(node.ex_iterable):
            raise UnsupportedConfigError(
                f"this datasets.IterableDataset applies {type(node).__name__} in {formatting.format_type} format "
                "after a shuffle buffer (.shuffle(buffer_size=...)), which reads the buffer by Arrow tables; the "
                "loader resumes a buffer exactly when the steps after it read examples: apply that map() or "
                "filter() before shuffle(), or without with_format() before it"
            )
        pending += _children(node)
