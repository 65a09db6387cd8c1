"""Where the shuffle comes from: an epoch's order as a pure function of (seed, epoch).

The order never depends on the global RNG (which Accelerate restores in
``load_state``), on the world size, or on the worker count.
"""

from __future__ import annotations

from typing import Any, Optional, Sized

import torch
from torch.utils.data import DataLoader, RandomSampler, Sampler, SequentialSampler

from .. import _log
from ..checkpoint._state import YIELDING_SOURCES
from .._context import DistContext
from ..training._rng import preserved_globals, seed_globals
from ._sampler_rng import drawn_twice, reseed, user_seed
from ._seeds import mix_seed

logger = _log.get_logger(__name__)


def generator_for(seed: int, *salts: int) -> torch.Generator:
    """A CPU generator seeded from ``seed`` and ``salts``."""
    return torch.Generator().manual_seed(mix_seed(seed, *salts))


class EpochOrder:
    """The dataset indices of one epoch, in the order they are consumed.

    Subclasses decide the order; all return an int64 tensor of indices.
    """

    kind: str = "abstract"
    world_dependent = False  # whether the order changes with the number of processes (``_distributed``)
    padding = 0  # entries at the order's end that repeat earlier ones (not real samples)

    def __init__(self, num_samples: int) -> None:
        self.num_samples = num_samples
        self.config_length = num_samples  # the samples per epoch the user sees (``len(sampler)``)

    def at_world(self, world_size: int) -> "EpochOrder":
        """This order as it is on ``world_size`` processes (the same, unless ``world_dependent``)."""
        return self

    def indices(self, seed: int, epoch: int) -> torch.Tensor:
        raise NotImplementedError


class SequentialOrder(EpochOrder):
    """``0, 1, …, n-1`` every epoch (a ``SequentialSampler``)."""

    kind = "sequential"

    def indices(self, seed: int, epoch: int) -> torch.Tensor:
        return torch.arange(self.num_samples)


class ShuffledOrder(EpochOrder):
    """A fresh permutation per epoch, drawn from (seed, epoch) (a ``RandomSampler``)."""

    kind = "random"

    def indices(self, seed: int, epoch: int) -> torch.Tensor:
        return torch.randperm(self.num_samples, generator=generator_for(seed, epoch))


class SeedableOrder(EpochOrder):
    """Accelerate's ``SeedableRandomSampler`` (``use_seedable_sampler=True``, the 🤗 Trainer's default): epoch
    ``e`` is the permutation of a generator seeded with ``seed + e``, so a stock run's order is continued."""

    kind = "seedable-random"

    def indices(self, seed: int, epoch: int) -> torch.Tensor:
        return torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(seed + epoch))


# Orders of a plain ``RandomSampler``, each a pure function of (seed, epoch): a checkpoint keeps the one it
# was written in, whichever ``use_seedable_sampler`` says now.
SHUFFLES = {ShuffledOrder.kind: ShuffledOrder, SeedableOrder.kind: SeedableOrder}


class SamplerOrder(EpochOrder):
    """A user's own sampler, drawn once per epoch under an RNG seeded from (seed, epoch).

    Drawing the indices costs no data loading. The sampler gets ``set_epoch``
    when it has one; every RNG it holds, under any attribute name
    (``_sampler_rng``), and the global ``torch``, ``random`` and ``numpy`` RNGs
    are all seeded from (seed, epoch) while it is drawn, and the global RNGs
    are restored afterwards, so a sampler that draws its order from any of
    them is reproduced exactly and the training loop's own RNG stream is
    untouched. The first epoch is drawn twice: a sampler whose order still
    differs keeps randomness nothing can seed, and is refused.
    """

    def __init__(self, sampler: Sampler, dataset: Any = None) -> None:
        super().__init__(len(sampler) if isinstance(sampler, Sized) else -1)
        self.sampler = sampler
        self.kind = f"sampler:{type(sampler).__qualname__}"
        self.skip = () if dataset is None else (dataset,)
        self._checked = False

    def indices(self, seed: int, epoch: int) -> torch.Tensor:
        if self._checked:
            return self._draw(seed, epoch)
        drawn = drawn_twice(lambda: self._draw(seed, epoch), type(self.sampler).__name__)
        self._checked = True
        return drawn

    def _draw(self, seed: int, epoch: int) -> torch.Tensor:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
        reseed(self.sampler, seed, epoch, self.skip)
        with preserved_globals():
            seed_globals(mix_seed(seed, epoch, 1))
            drawn = torch.as_tensor(list(iter(self.sampler)), dtype=torch.int64)
        return drawn


def order_for(sampler: Sampler, dataset: Any, seedable: bool = False) -> EpochOrder:
    """The epoch order that reproduces ``sampler``, the sampler of a user's ``DataLoader`` over ``dataset``;
    ``seedable``: Accelerate's ``use_seedable_sampler``, which replaces a ``RandomSampler`` by its own."""
    dataset_length = len(dataset)
    if type(sampler) is SequentialSampler:
        return SequentialOrder(dataset_length)
    if _plain_shuffle(sampler, dataset_length):
        return SeedableOrder(dataset_length) if seedable else ShuffledOrder(dataset_length)
    return SamplerOrder(sampler, dataset)


def _plain_shuffle(sampler: Sampler, dataset_length: int) -> bool:
    return type(sampler) is RandomSampler and not sampler.replacement and sampler.num_samples == dataset_length


def choose_seed(dataloader: DataLoader, data_seed: Optional[int], ctx: DistContext,
                seedable: bool = False) -> tuple[int, str]:
    """The seed of the epoch orders, agreed across ranks: the user's choice, else one drawn at random.

    Rank 0's wins, as in Accelerate (``synchronize_rng_states`` hands every rank rank 0's generator): a
    generator seeded per rank (``manual_seed(1000 + rank)``) would otherwise give each rank its own
    permutation, and some samples would go to two ranks and others to none. Where the ranks' seeds
    differed, the main process says so once.
    """
    seed, source = _local_seed(dataloader, data_seed, seedable)
    everyone = ctx.all_gather(seed)
    if source not in YIELDING_SOURCES and any(other != everyone[0] for other in everyone[1:]) and ctx.is_main:
        shown = ", ".join(f"rank {rank}: {value}" for rank, value in enumerate(everyone))
        logger.warning(
            "the DataLoader's shuffle seed (%s) differs between processes (%s); every process uses rank 0's, %d, "
            "as Accelerate does, so that the processes share one order of the epoch and each reads its own part",
            "data_seed" if source == "data_seed" else "its generator", shown, everyone[0],
        )
    return int(everyone[0]), source


def _local_seed(dataloader: DataLoader, data_seed: Optional[int], seedable: bool) -> tuple[int, str]:
    """This rank's own seed of the epoch orders and where it comes from (``"data_seed"``, ``"generator"``,
    ``"initial_seed"``, ``"drawn"``)."""
    if data_seed is not None:
        return int(data_seed), "data_seed"
    if seedable and _plain_shuffle(dataloader.sampler, len(dataloader.dataset)):
        return int(torch.random.initial_seed()), "initial_seed"  # as SeedableRandomSampler: set_seed()'s seed
    held = user_seed(dataloader.sampler, (dataloader.dataset,))
    if held is not None:
        return held, "generator"
    if isinstance(dataloader.generator, torch.Generator):
        return int(dataloader.generator.initial_seed()), "generator"
    return int(torch.empty((), dtype=torch.int64).random_().item()), "drawn"
