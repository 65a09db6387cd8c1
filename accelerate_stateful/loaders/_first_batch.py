"""The first items of a pass, read again by a resumed pass that must pad its last global batch.

Without ``drop_last``, a stream read by every rank pads its short last global batch with the pass's first
global batch, as Accelerate's ``IterableDatasetShard`` does (``_stream.Slicer``). A pass that read that
batch itself keeps it in memory. A checkpoint does not hold it: it is ``world_size x batch_size`` items
that every rank would write into every snapshot, so the state of every rank would grow with the number of
ranks. A resumed pass that reaches a short last global batch reads the items it needs again instead:
this logical worker's share of the stream opened as the pass itself began (the dataset put where a fresh
pass starts, the epoch set, the stream's global RNG states of the pass start), then the dataset's position
and the RNG states are put back, so the re-read changes nothing the rest of the pass or the next epoch sees. Rank ``r``
needs at most the first ``(r + 1) x batch_size`` items. An opaque stream (no ``state_dict()``) is
iterated again from its start, as its fast-forward does.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Optional

from . import _stream_rng
from ._snapshot import DatasetPosition, set_epoch


class Rereader:
    """Made at the start of a resumed pass, before its saved position is loaded; called at most once, after the
    pass read its last item."""

    def __init__(self, dataset: Any, position: Optional[DatasetPosition], epoch: int) -> None:
        self._dataset, self._position, self._epoch = dataset, position, epoch
        self._rng = _stream_rng.record()  # the stream's RNG states at the pass start

    def __call__(self, count: int) -> list:
        """The first ``count`` items of the pass (fewer if the stream is shorter); RNG states and the dataset's
        position as they were."""
        now = _stream_rng.record()
        _stream_rng.apply(self._rng)
        try:
            with contextlib.ExitStack() as stack:
                dataset = self._dataset if self._position is None else stack.enter_context(
                    self._position.at_pass_start())
                set_epoch(dataset, self._epoch, unless_set=True)
                return list(itertools.islice(iter(dataset), count))
        finally:
            _stream_rng.apply(now)
