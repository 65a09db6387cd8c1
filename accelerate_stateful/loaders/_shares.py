"""Logical workers dealt to another number of physical readers: a stream resumed with another ``num_workers``.

A stream read by ``L`` workers has ``L`` logical workers (shares), each with its own position. The
base loader hands batches out round-robin over physical workers, skipping those whose stream ended
(``_stream``), so the uninterrupted run delivers the shares' batches round-robin, from the share
after the last one taken, skipping ended shares. A pass that continues those ``L`` shares on ``P``
readers (``P = max(num_workers, 1)``, the main process when there are no workers) deals them into
``k * P`` slots, ``k = ceil(L / P)``: slot ``t`` holds share ``(t + rotation) % L`` (empty for
``t >= L``) and belongs to reader ``t % P``. Each reader plays its ``k`` slots in rounds, one item per
slot: a batch, or a marker when the slot is empty or its share ended, as long as one of its shares is
still running. Every reader emits ``k`` items per round, so the base loader's round-robin over readers
delivers the slots in order ``0, 1, ...``; dropping the markers leaves exactly the uninterrupted
order. A reader whose shares all ended stops: the base loader skips it, and what it would have sent
were markers only. With ``P >= L`` a reader plays one share or none (it stops at once).

A reader that plays several shares, or one share seen otherwise than its process is (a worker
continuing the main process's stream, the main process continuing a worker's), reads each share from
its own copy of the dataset and, around every read, makes ``get_worker_info()`` report that share as
the uninterrupted run's worker (``id``, ``num_workers``, ``seed``, the copy), or ``None`` for the main
process's stream, and swaps in the share's own ``torch``/``random``/``numpy`` global RNG states,
seeded as that worker's (or the main process's stream's) were at the start of the pass (``_stream_rng``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from ._channels import WorkerStart
from ._stream_rng import OwnRNG
from ..sources._global import shown_worker_info
from ..position._order import mix_seed

MARKER = (None, 0, None)  # an item that stands for an empty or ended slot; the main process drops it


@dataclass
class Deal:
    """What one reader plays in a pass: its slots, and how the shares are seen."""

    generation: int
    slots: list[Optional[WorkerStart]]
    shown_workers: int  # the num_workers the shares were read with; 0: read by the main process
    base_seed: int  # the base loader's worker seed of the pass: worker ``w``'s seed derives from it

    def plain(self, in_worker: bool) -> bool:
        """One share, seen as this reader's process is: read as before, without copies or swaps."""
        return len(self.slots) == 1 and (self.shown_workers > 0) == in_worker


def deal(starts: list[WorkerStart], rotation: int, readers: int, shown_workers: int,
         base_seed: int) -> tuple[list[Deal], list[int]]:
    """Each reader's deal, and the reader that plays each share (see the module docstring)."""
    count = len(starts)
    per = -(-count // readers)
    slots = [starts[(t + rotation) % count] if t < count else None for t in range(per * readers)]
    deals = [Deal(starts[0].generation, slots[p::readers], shown_workers, base_seed) for p in range(readers)]
    holders = [((w - rotation) % count) % readers for w in range(count)]
    return deals, holders


def worker_base_seed(generator_seed: int) -> int:
    """The base seed torch draws for a pass's workers from a generator seeded with ``generator_seed``."""
    generator = torch.Generator()
    generator.manual_seed(generator_seed)
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def play(stream: Any, deal_: Deal, physical: Optional[int]) -> Iterator[Any]:
    """The items of one reader's slots, round by round (``stream`` is the ``StreamDataset``)."""
    shares = [_Share(stream, start, deal_) if start is not None else None for start in deal_.slots]
    while any(share is not None and not share.ended for share in shares):
        for share in shares:
            item = share.next() if share is not None and not share.ended else None
            yield MARKER if item is None else item
    if physical is not None:
        stream.bequeath(physical, deal_.generation)


class _Share:
    """One logical worker read in this process: its dataset copy, its view and its own RNG states."""

    def __init__(self, stream: Any, start: WorkerStart, deal_: Deal) -> None:
        if stream.stateful:
            position = stream.position.fork()
            dataset = position.dataset
        else:
            position, dataset = None, copy.deepcopy(stream.dataset)
        self.ended = False
        self._info: Any = None
        seed = mix_seed(deal_.base_seed, start.epoch, start.logical)
        if deal_.shown_workers > 0:
            from torch.utils.data._utils.worker import WorkerInfo

            self._info = WorkerInfo(id=start.logical, num_workers=deal_.shown_workers, seed=seed, dataset=dataset)
        self._rng = OwnRNG(seed)
        self._batches = stream.share_batches(start, dataset, position)

    def next(self) -> Optional[Any]:
        """The share's next item, or None once it ended."""
        with shown_worker_info(self._info), self._rng.active():
            item = next(self._batches, None)
        self.ended = item is None
        return item
