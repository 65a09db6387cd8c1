"""A dispatcher moved by ``seek`` (``skip_first_batches``, a stock checkpoint's resume) pads its last step as the
uninterrupted run does: with the epoch's first samples, fetched again by the reader, never with the first step
this pass happened to read.

Ranks are simulated in this process (each runs the reader itself, as without a process group). The dataset draws
from the global RNGs in ``__getitem__``, so a padding fetched under another scope would show. The real-process
path is ``test_stock_checkpoints``'s.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler

from accelerate_stateful import DispatchDataLoader, DistContext, Mixture
from accelerate_stateful.errors import UnsupportedConfigError
from accelerate_stateful.training._rng import global_states


class Augmented(Dataset):
    """Sample ``i``: its id times a million, plus draws of ``random`` and ``torch`` (an augmentation)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i * 10**6 + random.randrange(1000) * 1000 + int(torch.randint(0, 1000, ()))


def _dispatcher(cfg: dict, rank: int) -> DispatchDataLoader:
    n, bs, workers = cfg["n"], cfg["bs"], cfg["workers"]
    if cfg["sampler"] == "batch_sampler":
        batches = BatchSampler(RandomSampler(range(n), generator=torch.Generator().manual_seed(3)), bs, False)
        dl = DataLoader(Augmented(n), batch_sampler=batches, num_workers=workers)
    else:
        dl = DataLoader(Augmented(n), batch_size=bs, shuffle=True, num_workers=workers,
                        generator=torch.Generator().manual_seed(5))
    return DispatchDataLoader.from_dataloader(dl, DistContext(rank, cfg["world"]), split_batches=cfg["split"])


def _epochs(loaders: list, epochs: int = 2) -> list[list[list[int]]]:
    return [[batch.tolist() for _ in range(epochs) for batch in loader] for loader in loaders]


def _configs() -> list:
    found = []
    for world, n, bs, split, sampler in itertools.product((2, 3), (7, 11), (2, 3), (False, True),
                                                          ("shuffle", "batch_sampler")):
        if split and bs % world:
            continue
        workers = 2 if (n + bs + world) % 4 == 0 else 0  # a few with workers: each start costs a second
        found.append(pytest.param(dict(world=world, n=n, bs=bs, split=split, sampler=sampler, workers=workers),
                                  id=f"w{world}-n{n}-bs{bs}-split{int(split)}-{sampler}-workers{workers}"))
    return found


@pytest.mark.parametrize("cfg", _configs())
def test_a_dispatcher_moved_by_seek_gives_the_uninterrupted_runs_batches_padding_included(cfg):
    """From every step of the first epoch, and through a save and a load after the seek: the rest of the epoch and
    the next one, as the uninterrupted run had them (samples, padding and augmentations alike)."""
    world = cfg["world"]
    full = _epochs([_dispatcher(cfg, r) for r in range(world)])
    steps = len(_dispatcher(cfg, 0))
    for k in range(1, steps):
        moved = [_dispatcher(cfg, r) for r in range(world)]
        for loader in moved:
            loader.seek(k)
        assert _epochs(moved) == [batches[k:] for batches in full], f"seek({k})"
        # saved one step after the seek (the padding not read yet), resumed by a fresh loader
        saved = []
        for loader in [_dispatcher(cfg, r) for r in range(world)]:
            loader.seek(k)
            it = iter(loader)
            next(it)
            saved.append(loader.state_dict())
            del it
        resumed = [_dispatcher(cfg, r) for r in range(world)]
        for loader, state in zip(resumed, saved):
            loader.load_state_dict(state)
        assert _epochs(resumed) == [batches[k + 1:] for batches in full], f"seek({k}), saved, resumed"


def test_fetching_the_padding_again_leaves_the_processs_rngs_as_they_were():
    cfg = dict(world=2, n=11, bs=2, split=False, sampler="shuffle", workers=0)
    loader = _dispatcher(cfg, 1)
    loader.seek(1)
    it = iter(loader)
    next(it)  # step 1 of 3: the last, padded, comes next
    torch.manual_seed(11)
    random.seed(11)
    before = global_states()
    next(it)
    assert loader.end_of_dataloader
    after = global_states()
    assert repr(after) == repr(before)


def test_a_dispatcher_over_a_stream_refuses_seek_with_the_reason_instead_of_a_type_error():
    dl = DataLoader(Mixture({"a": list(range(20))}, {"a": 1}, seed=1), batch_size=2)
    loader = DispatchDataLoader.from_dataloader(dl, DistContext(0, 2))
    with pytest.raises(UnsupportedConfigError, match="cannot move an iterable dataset without reading it"):
        loader.seek(1)
