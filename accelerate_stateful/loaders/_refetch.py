"""Batches of an epoch fetched again, out of the pass, exactly as the pass fetched them.

A dispatcher moved by ``seek`` never read the epoch's first samples, which pad its last step
(``dispatch``); its reader fetches them again here. Each batch is fetched in the main process in its
batch's scope of the pipeline's randomness (``training/_rng``: the key ``(*where, step)``), as a
reader that reads ahead fetches it and as a worker applies it, so augmented values come out as they
did. The process's own RNG streams are left as they were.
"""

from __future__ import annotations

from typing import Any, Callable

from torch.utils.data import DataLoader

from ..training._rng import PipelineRNG, preserved_globals


def fetched_again(mode: str, dataset: Any, collate_fn: Callable, where: tuple[int, ...], first: int,
                  batches: list, *, as_sampler: bool = False) -> list:
    """``batches`` (index lists of steps ``first``, ``first + 1``, ...) fetched from ``dataset`` and collated.

    ``as_sampler``: the dataset is given each index list whole (a batch sampler passed as ``sampler=``).
    """
    pipeline = PipelineRNG(mode, 0, dataset, whole_batches=as_sampler)
    tag = pipeline.tagger(where)
    feed = [batch if tag is None else tag(first + i, batch) for i, batch in enumerate(batches)]
    kind = {"sampler": feed, "batch_size": None} if as_sampler else {"batch_sampler": feed}
    base = DataLoader(dataset, collate_fn=collate_fn, **kind)
    with preserved_globals():
        return list(pipeline.fetch(iter(base), where, first, read_ahead=True))
