"""🤗 ``datasets``' shuffle buffer, in its own order, resumed by reading a bounded stretch of its input again.

``IterableDataset.shuffle(buffer_size=B)`` (``BufferShuffledExamplesIterable``
in ``datasets`` 5) fills a buffer until it holds at least ``B`` rows, applies
one permutation drawn from its generator, hands out all but ``B // 2`` rows and
keeps the rest; at the input's end it permutes and hands out what is left. In
``for x in ds`` its input is read in tables (``iter_arrow``) when a formatting
step sits above it, and example by example otherwise; the buffer fills by
whole tables then. The epoch shuffles the shard order and shifts the generator
(``_prepare_ex_iterable_for_iteration``), which this module calls, on a copy,
to build exactly the pipeline stock iteration builds.

The cursor plays the same rounds. Its position is the current round: the rows
the buffer held when it was permuted, named by the number of rows read before
each, the generator's state before the permutation, how many of the round's
rows were handed out, and the input's state from before the oldest of those
rows. A resume reads the input again from there to the round's last row and
permutes again: nothing is lost or repeated, and no item is stored.
"""

from __future__ import annotations

import collections
import copy
import json
from typing import Any, Iterator, Optional

from ..errors import CheckpointError, UnsupportedConfigError
from ._global import Cursor, GlobalStream, hidden_worker_info, plain_copy

_POSITION_KEYS = {"from", "from_read", "read", "rows", "rng", "given", "final"}


class HFShuffled(GlobalStream):
    """The order of a shuffled 🤗 ``IterableDataset``, item for item, resumed exactly (see ``exact_shuffle``)."""

    def __init__(self, dataset: Any) -> None:
        _pipeline(dataset, 0)  # refuse a pipeline this cannot reproduce now, not at the first batch
        self.dataset = dataset

    def check_position(self, position: Any) -> None:
        _checked(position)

    def open(self, position: Optional[Any], epoch: int) -> Cursor:
        return _HFCursor(_pipeline(self.dataset, epoch), _checked(position))


class _Pipeline:
    """What stock iteration reads in one epoch: the buffer's input, generator, size, and how rows come out."""

    def __init__(self, buffer: Any, formatted: Optional[Any]) -> None:
        self.input, self.generator, self.size = buffer.ex_iterable, buffer.generator, buffer.buffer_size
        self.tables = formatted is not None and bool(formatted.ex_iterable.iter_arrow)
        self._formatted = formatted

    def chunks(self) -> Iterator[list]:
        """The input's rows in the groups the stock buffer adds them: a table's rows, or one example."""
        from datasets.formatting import PythonFormatter
        from datasets.iterable_dataset import _apply_feature_types_on_example, _batch_to_examples

        node = self._formatted
        if self.tables:
            formatter = PythonFormatter(features=None if node.ex_iterable.is_typed else node.features,
                                        token_per_repo_id=node.token_per_repo_id)
            for _, table in self.input.iter_arrow():
                yield list(_batch_to_examples(formatter.format_batch(_cast(table, node.features))))
            return
        typed = node is not None and node.features and not node.ex_iterable.is_typed
        for _, example in self.input:
            if typed:
                example = _apply_feature_types_on_example(example, node.features,
                                                          token_per_repo_id=node.token_per_repo_id)
            yield [example]


def _cast(table: Any, features: Any) -> Any:
    """``FormattedExamplesIterable._iter_arrow``: add the missing columns and cast to the features."""
    if not features:
        return table
    import pyarrow as pa
    from datasets.table import cast_table_to_features

    for name in features:
        if name not in table.column_names:
            table = table.append_column(name, pa.NullArray.from_buffers(pa.null(), len(table), [None]))
    return table if table.schema == features.arrow_schema else cast_table_to_features(table, features)


def plays_rounds(buffer_class: Any) -> bool:
    """Whether ``datasets``' shuffle buffer works in rounds (fill, one permutation, hand out all but half), the
    algorithm this module replays; older releases draw one random index per item (``_iter_random_indices``).
    Read from the code of its iteration, the same on every process."""
    names = set(buffer_class.__iter__.__code__.co_names)
    return "permutation" in names and "_iter_random_indices" not in names


def _pipeline(dataset: Any, epoch: int) -> _Pipeline:
    """Build stock iteration's pipeline for ``epoch`` on a copy, and find the shuffle buffer at its top."""
    from datasets import IterableDataset
    from datasets.iterable_dataset import (BufferShuffledExamplesIterable, FormattedExamplesIterable,
                                           RebatchedArrowExamplesIterable)

    if not isinstance(dataset, IterableDataset) or not isinstance(dataset._ex_iterable, BufferShuffledExamplesIterable):
        raise UnsupportedConfigError(
            f"exact_shuffle needs a datasets.IterableDataset whose last step is .shuffle(buffer_size=...), got "
            f"{_describe(dataset)}; apply map(), filter() and the like before shuffle(), or use Shuffled(dataset, ...)"
        )
    if not plays_rounds(BufferShuffledExamplesIterable):
        raise UnsupportedConfigError(
            f"exact_shuffle replays the shuffle buffer of datasets releases that permute it in rounds (5.2.0 does); "
            f"datasets {_version()} draws one index per item instead, which it does not reproduce, so its resume "
            "would not be exact. Upgrade datasets, or shuffle with Shuffled(dataset_without_shuffle, buffer_size, "
            "seed=...), the package's own buffer"
        )
    if dataset._formatting is not None or dataset._distributed is not None:
        step = "with_format()" if dataset._formatting is not None else "split_dataset_by_node()"
        raise UnsupportedConfigError(
            f"exact_shuffle reproduces a dataset without {step}; leave it out (the loader splits the stream between "
            "processes and workers; format items in the collate function)"
        )
    twin = copy.copy(dataset)
    twin._ex_iterable = copy.deepcopy(dataset._ex_iterable)  # the pipeline records its reading in its nodes
    twin._epoch, twin._starting_state_dict = int(epoch), None
    with hidden_worker_info():
        node = twin._prepare_ex_iterable_for_iteration()
    formatted = None
    if isinstance(node, FormattedExamplesIterable) and node.formatting is None:
        formatted, node = node, node.ex_iterable
    if isinstance(node, RebatchedArrowExamplesIterable) and node.batch_size == 1:
        node = node.ex_iterable
    if not isinstance(node, BufferShuffledExamplesIterable):  # pragma: no cover - a datasets version this predates
        raise UnsupportedConfigError(
            f"exact_shuffle does not know how datasets {_version()} iterates this dataset (found "
            f"{type(node).__name__} above the shuffle buffer); use Shuffled(dataset, buffer_size, seed=...) instead"
        )
    return _Pipeline(node, formatted)


class _HFCursor:
    """Stock rounds over the input, with the input's state kept every ``size / 16`` rows to read again from."""

    def __init__(self, pipeline: _Pipeline, saved: Optional[dict]) -> None:
        self._size = pipeline.size
        self._every = max(1, pipeline.size // 16)
        self._input = pipeline.input
        self._rng = copy.deepcopy(pipeline.generator)
        start = saved or {"from": None, "from_read": 0, "read": 0, "rows": [], "rng": None, "given": 0, "final": False}
        if start["from"] is not None:
            self._input.load_state_dict(copy.deepcopy(start["from"]))
        self._chunks = _with_hidden_worker(pipeline.chunks())
        self._marks = collections.deque([(start["from_read"], start["from"])])
        self._read, self._ended = start["from_read"], False
        self._rows: list = []  # the buffer: read number of each row, and the row
        self._items: list = []
        self._round: Optional[dict] = None
        self._out: list = []  # the current round's rows to hand out, and how many were
        self._given = 0
        if saved is not None:
            self._resume(saved)

    def _resume(self, saved: dict) -> None:
        wanted = set(saved["rows"])
        found = {}
        while self._read < saved["read"]:
            for number, item in self._next_chunk():
                if number in wanted:
                    found[number] = item
        if self._read != saved["read"] or len(found) != len(wanted) or len(wanted) != len(saved["rows"]):
            raise CheckpointError(
                f"the shuffled dataset now reads differently from the one that saved this position (rows "
                f"{self._read} read where it had read {saved['read']}); resume with the same data files and datasets "
                "version, or start the run without loading"
            )
        self._rows, self._items = list(saved["rows"]), [found[n] for n in saved["rows"]]
        self._rng.bit_generator.state = json.loads(saved["rng"])
        self._permute(saved["final"])
        self._given = saved["given"]

    def _next_chunk(self) -> list:
        if self._read - self._marks[-1][0] >= self._every:
            self._marks.append((self._read, self._input.state_dict()))
        chunk = next(self._chunks)
        first, self._read = self._read, self._read + len(chunk)
        return list(zip(range(first, self._read), chunk))

    def _permute(self, final: bool) -> None:
        """One stock round: permute the buffer, hand out all but ``size // 2`` rows (all at the end)."""
        self._round = {"rows": tuple(self._rows), "read": self._read, "final": final,
                       "rng": json.dumps(self._rng.bit_generator.state)}
        oldest = min(self._rows)
        while len(self._marks) > 1 and self._marks[1][0] <= oldest:
            self._marks.popleft()
        order = self._rng.permutation(len(self._rows)).tolist()
        handed = len(order) if final else len(order) - self._size // 2
        self._out, self._given = [self._items[i] for i in order[:handed]], 0
        self._rows = [self._rows[i] for i in order[handed:]]
        self._items = [self._items[i] for i in order[handed:]]

    def __next__(self) -> Any:
        while self._given == len(self._out):
            if self._round is not None and self._round["final"]:
                raise StopIteration
            while len(self._rows) < self._size and not self._ended:
                try:
                    for number, item in self._next_chunk():
                        self._rows.append(number)
                        self._items.append(item)
                except StopIteration:
                    self._ended = True
            if not self._rows:
                raise StopIteration
            self._permute(final=len(self._rows) < self._size)
        self._given += 1
        return self._out[self._given - 1]

    def position(self) -> Optional[dict]:
        """The current round; after the input's end with nothing left, still the last round, all handed out."""
        if self._round is None:
            return None
        read, state = self._marks[0]
        return {"from": plain_copy(state), "from_read": read, "given": self._given, **self._round}


def _with_hidden_worker(chunks: Iterator[list]) -> Iterator[list]:
    """Read the input as one reader: a ``datasets`` iterable that saw a DataLoader worker would read its share."""
    while True:
        with hidden_worker_info():
            chunk = next(chunks, None)
        if chunk is None:
            return
        yield chunk


def _checked(position: Optional[Any]) -> Optional[dict]:
    if position is None or (isinstance(position, dict) and set(position) == _POSITION_KEYS
                            and isinstance(position["rows"], (list, tuple)) and isinstance(position["rng"], str)
                            and isinstance(position["final"], bool) and all(
                                isinstance(position[key], int) and not isinstance(position[key], bool)
                                and position[key] >= 0 for key in ("from_read", "read", "given"))):
        return position
    raise CheckpointError(
        f"the saved position of an exact_shuffle source is not one it wrote (got {str(position)[:200]}); resume from "
        "a checkpoint written with this source, or start the run without loading"
    )


def _describe(dataset: Any) -> str:
    from datasets import IterableDataset

    if isinstance(dataset, IterableDataset):
        return f"an IterableDataset whose last step is {type(dataset._ex_iterable).__name__}"
    return f"a {type(dataset).__name__}"


def _version() -> str:
    import datasets

    return datasets.__version__
