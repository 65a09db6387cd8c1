"""The base loader's batches read without torch's per-batch profiler annotation (``loaders/_torch_iter``) are
torch's batches: the same values, end, count and errors; and under a profiler, the same spans as a plain
``DataLoader``'s."""

from __future__ import annotations

import pytest
import torch
from accelerate.utils import DataLoaderConfiguration
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader, Dataset, IterableDataset

from accelerate_stateful import Accelerator
from accelerate_stateful.loaders._torch_iter import batches_of

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


class Squares(Dataset):
    def __init__(self, size: int, fail_at: int = -1) -> None:
        self.size, self.fail_at = size, fail_at

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        if index == self.fail_at:
            raise ValueError(f"bad item {index}")
        return {"x": torch.tensor([index * index]), "i": index}


class Counting(IterableDataset):
    def __iter__(self):
        return iter(range(10))


def _loader(dataset, **kw) -> DataLoader:
    return DataLoader(dataset, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3), **kw)


def _same(a, b) -> bool:
    return a["i"].tolist() == b["i"].tolist() and torch.equal(a["x"], b["x"])


@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)])  # persistent needs workers
def test_same_batches_end_and_count(workers, persistent):
    loader = _loader(Squares(18), num_workers=workers, persistent_workers=persistent)
    twin = _loader(Squares(18), num_workers=workers, persistent_workers=persistent)
    for _ in range(2):  # a second pass: persistent workers reset their iterator
        expected = list(twin)
        base_iter = iter(loader)
        got = list(batches_of(base_iter))
        assert len(got) == len(expected) == 5 and all(map(_same, got, expected))
        assert base_iter._num_yielded == 5  # what __next__ counts


def test_errors_are_torchs():
    with pytest.raises(ValueError, match="bad item 7"):
        list(batches_of(iter(_loader(Squares(18, fail_at=7)))))


def test_other_iterators_read_through_next():
    """An IterableDataset's iterator (its __next__ warns past len()) and a subclass's are returned as they are."""
    iterable = iter(DataLoader(Counting(), batch_size=4))
    assert batches_of(iterable) is iterable

    class Own(DataLoader):
        def __iter__(self):
            return iter([torch.tensor([1])])

    own = iter(Own(Squares(4)))
    assert batches_of(own) is own


def _loader_spans(loader) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in loader:
            pass
    return sum(1 for event in prof.events() if "DataLoader" in event.name and "__next__" in event.name)


def test_profiled_pass_has_the_plain_loaders_spans():
    """Under torch's profiler a prepared loader's batches carry the span a plain DataLoader's do."""
    plain = _loader_spans(_loader(Squares(18)))
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    ours = _loader_spans(accelerator.prepare(_loader(Squares(18))))
    assert plain >= 5 and ours == plain
