"""After a resume on another number of processes: what the training loop's collectives depend on agrees.

Accelerate's ``load_state`` restores, on each rank, that rank's own ``random_states_<rank>.pkl``, which
also carries ``accelerator.step`` (the position in the gradient-accumulation window). On another
number of processes, a rank that did not exist when the checkpoint was written finds no such file:
it keeps ``step=0`` while the others restore theirs, so they disagree on which step syncs gradients
and deadlock in ``backward``; and its random states are whatever the script set before loading.

The rule: after loading a checkpoint written on another number of processes,

- ``accelerator.step`` is the saved main process's on every rank (every saved rank had the same, since
  they step together), so every rank syncs gradients at the same step;
- a rank that did not exist when the checkpoint was written seeds Python's, NumPy's and torch's RNGs
  (CPU and accelerators) from ``mix_seed(s, rank)``, where ``s`` is the first 63-bit number the main
  process's restored torch RNG would draw (drawn from a copy; the main process's own RNG is untouched):
  a pure function of the checkpoint and the rank, different for every rank. One log line says so.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from .. import _log
from .._context import DistContext
from ..position._order import mix_seed

logger = _log.get_logger(__name__)


def agree_after_elastic_load(accelerator: Any, saved_world: int, checkpoint: Any) -> None:
    """Make ``accelerator.step`` and the new ranks' RNGs follow the checkpoint (see the module's rule)."""
    ctx = DistContext.detect()
    step, base = ctx.broadcast((int(accelerator.step), _draw_base_seed()) if ctx.is_main else None)
    accelerator.step = step
    rank = accelerator.process_index
    if rank >= saved_world:
        seed = mix_seed(base, rank)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)  # seeds every accelerator's generators too
        logger.warning(
            "rank %d did not exist when %s was written (%d processes): its random states are seeded with %d, "
            "derived from the main process's saved random state and this rank",
            rank, checkpoint, saved_world, seed,
        )


def _draw_base_seed() -> int:
    """The first 63-bit number the (restored) torch RNG of this process would draw, without drawing it."""
    generator = torch.Generator()
    generator.set_state(torch.get_rng_state())
    return int(torch.randint(0, 2**62, (1,), generator=generator).item())


def new_rank_seed(torch_rng_state: torch.Tensor, rank: int) -> int:
    """The seed a rank that did not exist gets, from the saved main process's torch RNG state (for checks)."""
    generator = torch.Generator()
    generator.set_state(torch_rng_state)
    return mix_seed(int(torch.randint(0, 2**62, (1,), generator=generator).item()), rank)
