"""The skip variant: ``accelerator.skip_first_batches`` without replay, and still stateful."""

from __future__ import annotations

from typing import Any, Iterator, Mapping

from torch.utils.data import DataLoader

from ._adapter import DataLoaderAdapter


class SkipDataLoader:
    """A view of a prepared loader, moved ``num_batches`` into its current epoch.

    Nothing before that batch is read: the loader's position is moved at once,
    not fast-forwarded. The view shares the position of the loader it wraps
    (the one ``save_state`` records), so a checkpoint taken before or while
    iterating it is exact. The skip applies to the current epoch only; later
    epochs are those of the wrapped loader. ``num_batches`` counts from the
    start of the epoch, whatever position the loader had.

    Examples:
        >>> skipped = accelerator.skip_first_batches(train_dl, 100)   # doctest: +SKIP
        >>> for batch in skipped:                                     # batch 100 onwards
        ...     ...
    """

    def __init__(self, loader: DataLoaderAdapter, num_batches: int) -> None:
        if not isinstance(loader, DataLoaderAdapter):
            raise TypeError(f"SkipDataLoader wraps a prepared stateful loader, got {type(loader).__name__}")
        loader.seek(num_batches)
        self._loader = loader
        self.skip_batches = num_batches
        self._skip_epoch = loader.epoch

    def __iter__(self) -> Iterator[Any]:
        return iter(self._loader)

    def __len__(self) -> int:
        """Batches this view yields in the skipped epoch; a whole epoch's afterwards."""
        skipped = self.skip_batches if self._loader.epoch == self._skip_epoch else 0
        return len(self._loader) - skipped

    def unwrap(self) -> DataLoader:
        return self._loader.unwrap()

    @property
    def loader(self) -> DataLoaderAdapter:
        """The prepared loader this view moves."""
        return self._loader

    @property
    def epoch(self) -> int:
        return self._loader.epoch

    @property
    def batches_yielded(self) -> int:
        return self._loader.batches_yielded

    @property
    def end_of_dataloader(self) -> bool:
        return self._loader.end_of_dataloader

    @property
    def remainder(self) -> int:
        return self._loader.remainder

    @property
    def dataset(self) -> Any:
        return self._loader.dataset

    @property
    def batch_size(self) -> int:
        return self._loader.batch_size

    @property
    def total_batch_size(self) -> int:
        return self._loader.total_batch_size

    def set_epoch(self, epoch: int) -> None:
        self._loader.set_epoch(epoch)

    def state_dict(self) -> dict:
        return self._loader.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self._loader.load_state_dict(state_dict)
