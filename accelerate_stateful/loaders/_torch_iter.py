"""A torch ``DataLoader`` iterator's batches, without the profiler annotation torch opens around each one.

torch's ``_BaseDataLoaderIter.__next__`` wraps every batch in ``torch.autograd.profiler.record_function``, a
dispatched operator call on entry and another on exit, whether or not a profiler records. For a map-style
dataset fetched in the main process that is most of what the iterator adds to the fetch itself: 9.6 µs of a
36 µs batch of 32 integers here (docs/benchmarks.md, section A), more than this package's whole per-batch
work. While no profiler records, :func:`batches_of` calls the iterator's own fetch (``_next_data``: the sampler,
the fetcher, ``pin_memory``) and counts the batch as ``__next__`` does; while one records, it calls
``__next__``, so a trace shows the same spans as a plain ``DataLoader``'s. Profiling often runs on one rank
only; both ways hand out the same batch and count it alike, so what a rank reads or decides never depends on
it. An iterator of another class (a
subclass may override ``__next__``) or over an ``IterableDataset`` (whose ``__next__`` also warns when the
dataset yields more than its ``len()``) is read through ``__next__`` always.
"""

from __future__ import annotations

from typing import Any, Iterator

from torch.autograd import _profiler_enabled
from torch.utils.data.dataloader import _DatasetKind, _MultiProcessingDataLoaderIter, _SingleProcessDataLoaderIter

_TORCH_OWN = (_SingleProcessDataLoaderIter, _MultiProcessingDataLoaderIter)


def batches_of(base_iter: Any) -> Iterator[Any]:
    """``base_iter``'s batches: the same objects, in the same order, with the same end and the same errors."""
    if type(base_iter) not in _TORCH_OWN or base_iter._dataset_kind != _DatasetKind.Map:
        return base_iter
    return _unannotated(base_iter)


def _unannotated(base_iter: Any) -> Iterator[Any]:
    fetch = base_iter._next_data
    while True:
        try:
            if _profiler_enabled() or base_iter._sampler_iter is None:  # recorded, or torch's own reset first
                batch = next(base_iter)
            else:
                batch = fetch()
                base_iter._num_yielded += 1
        except StopIteration:
            return
        yield batch
