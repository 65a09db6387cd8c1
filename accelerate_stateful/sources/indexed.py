"""Object-store streaming datasets read by index, in this package's order.

mosaicml-streaming's and litdata's ``StreamingDataset`` are ``IterableDataset`` subclasses, but both read any
sample by its global index (``dataset[i]``) over shards they download and cache themselves. Read that way,
they are map-style datasets: the loader's global order (a pure function of seed and epoch) decides which
index comes next, so a resume on another number of processes or workers is exact, and their download,
cache and shard handling stays theirs. Their own iteration (their shuffle, their partition over ranks and
workers, their resume) is not used.

Their ``len()`` is the number of samples of *one rank* of the current run; the length read here is the
dataset's own number of samples, the same on every topology.
"""

from __future__ import annotations

from typing import Any, Optional

from torch.utils.data import Dataset

from ..errors import UnsupportedConfigError

MOSAIC, LITDATA = "mosaicml-streaming", "litdata"
_LIBRARIES = {"streaming.": MOSAIC, "litdata.": LITDATA}  # the module a StreamingDataset class comes from


def stream_library(dataset: Any) -> Optional[str]:
    """The library whose ``StreamingDataset`` (or a subclass of it) ``dataset`` is, else ``None``.

    Decided from the class alone, so neither library is imported for a dataset that is not theirs.
    """
    for klass in type(dataset).__mro__:
        if klass.__name__ == "StreamingDataset":
            for prefix, library in _LIBRARIES.items():
                if klass.__module__.startswith(prefix):
                    return library
    return None


class Indexed(Dataset):
    """A mosaicml-streaming or litdata ``StreamingDataset`` as a map-style dataset, read by global index.

    Give it to a ``DataLoader`` (``shuffle=True`` shuffles in the loader's own elastic order) or to a
    composable source (``Mixture``, ``Packed``, ``Shuffled``, ``Filtered``). Both also recognise a bare
    ``StreamingDataset`` and read it through this class, in index order.

    Examples:
        >>> from streaming import StreamingDataset                                    # doctest: +SKIP
        >>> data = StreamingDataset(remote="s3://bucket/mds", local="/tmp/mds", batch_size=8)  # doctest: +SKIP
        >>> dl = DataLoader(Indexed(data), batch_size=8, shuffle=True)               # doctest: +SKIP

    Args:
        dataset: The ``StreamingDataset``, built with ``shuffle=False`` (the default of both libraries).

    Raises:
        UnsupportedConfigError: ``dataset`` is not one of theirs, or its own shuffle or resampling is on: those
            apply only to its own iteration, so they would be silently ignored here.
    """

    def __init__(self, dataset: Any) -> None:
        library = stream_library(dataset)
        if library is None:
            raise UnsupportedConfigError(
                f"Indexed reads a mosaicml-streaming or litdata StreamingDataset, not a {type(dataset).__name__}; "
                "give any other map-style dataset to the DataLoader as it is"
            )
        _refuse_own_order(dataset, library)
        self.dataset = dataset
        self.library = library
        self._length = _samples(dataset, library)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> Any:
        return self.dataset[int(index)]

    def __repr__(self) -> str:
        return f"Indexed({self.library} {type(self.dataset).__name__}, {self._length} samples)"


def as_indexed(dataset: Any) -> Any:
    """``Indexed(dataset)`` for a streaming dataset, else ``dataset`` itself."""
    return Indexed(dataset) if stream_library(dataset) is not None else dataset


def _samples(dataset: Any, library: str) -> int:
    if library == MOSAIC:
        return int(dataset.num_samples)
    # litdata: the samples of each chunk it reads (after its ``subsample``), known from its index alone.
    return sum(int(stop) - int(start) for start, stop in dataset.region_of_interest)


def _refuse_own_order(dataset: Any, library: str) -> None:
    fix = ("pass shuffle=False and shuffle in the loader's order instead: DataLoader(Indexed(dataset), "
           "shuffle=True), or accelerate_stateful.Shuffled for a buffer")
    if getattr(dataset, "shuffle", False):
        raise UnsupportedConfigError(
            f"this {library} StreamingDataset was built with shuffle=True, which shuffles only its own iteration; "
            f"accelerate-stateful reads it by index in one global order (so a resume on any number of processes "
            f"or workers is exact) and would silently ignore it; {fix}"
        )
    if library == MOSAIC and int(dataset.epoch_size) != int(dataset.num_samples):
        raise UnsupportedConfigError(
            f"this mosaicml-streaming StreamingDataset resamples its epoch ({dataset.epoch_size} samples drawn from "
            f"{dataset.num_samples}: epoch_size=..., or a Stream's proportion/repeat/choose), which only its own "
            "iteration applies; accelerate-stateful reads it by index and would silently ignore it. Build it "
            "without them, and weight several datasets with accelerate_stateful.Mixture instead"
        )
