"""A shard loader's batches as dataset indices, from its saved state alone, without torch (``samples``).

Importing torch is most of a ``samples`` call's time (seconds), and a shard loader's batches need none of it:
the plan and the checks ``inspect`` uses (``_position``) say which positions of the epoch's order a batch
holds, and the order is a pure function of (seed, epoch). A sequential order is ``0 .. n-1``; a shuffled one
is ``torch.randperm(n)`` under a CPU generator seeded with the order's seed, which :func:`randperm` draws
again bit for bit: torch's CPU generator is the standard MT19937 (``std::mt19937``) seeded with the low 32
bits of its seed, as Python's own ``random`` engine is once given the same state, and below
``2**32 / 20`` samples ``randperm`` is a Fisher-Yates shuffle taking ``random() % (n - i)`` at step ``i``.
The saved fingerprint of the order is checked as a resume checks it, so an order drawn otherwise is refused,
never printed. ``tests/test_cli_samples.py`` holds every answer against the loaders resumed from the states.

Everything else (a dispatcher, a ``DistributedSampler``'s order, an elastic resume, a very long epoch, where
importing torch costs less than the pure-Python shuffle) goes to the loaders themselves (``_loaders``).
"""

from __future__ import annotations

import hashlib
import random
import struct
from typing import Any, Mapping, Optional

from ..checkpoint import _refusals
from ..checkpoint import _state as S
from ..loaders._passes import PASS
from ..position._plan import ShardPlan
from ..position._saved import shard_plan, striped_settings
from ..position._seeds import mix_seed
from ..position._skips import of_epoch
from ._position import _shard

# Above this many samples, importing torch and drawing its randperm is faster than the shuffle in Python
# (about 1 µs a sample on the development machine).
MAX_SAMPLES = 1_000_000


def randperm(n: int, seed: int) -> list[int]:
    """``torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()``, without torch."""
    engine = random.Random()
    engine.setstate((3, (*_mt19937_state(seed & 0xFFFFFFFF), 624), None))
    bits, order = engine.getrandbits, list(range(n))
    for i in range(n - 1):
        z = i + bits(32) % (n - i)
        order[i], order[z] = order[z], order[i]
    return order


def _mt19937_state(seed: int) -> list[int]:
    """MT19937's 624 words after ``init_genrand(seed)``, the seeding of ``std::mt19937`` and torch's generator."""
    words = [seed]
    for i in range(1, 624):
        words.append((1812433253 * (words[-1] ^ (words[-1] >> 30)) + i) & 0xFFFFFFFF)
    return words


_ORDERS = {
    "sequential": lambda n, seed, epoch: list(range(n)),
    "random": lambda n, seed, epoch: randperm(n, mix_seed(seed, epoch)),  # ``_order.ShuffledOrder``
    "seedable-random": lambda n, seed, epoch: randperm(n, seed + epoch),  # ``_order.SeedableOrder``
}


def answerable(states: list, rank: int, world: int) -> bool:
    """Whether :func:`rank_position` and :func:`rank_batches` answer for ``rank`` of ``world`` (else the loaders do)."""
    state = states[rank] if len(states) == world else None
    if state is None or state.get(S.MODE) != S.SHARD_MODE or S.ORDER_WORLD in state:
        return False
    config = state.get(S.CONFIG)
    return (isinstance(config, Mapping) and config.get("order") in _ORDERS
            and isinstance(config.get("num_samples"), int) and 0 <= config["num_samples"] <= MAX_SAMPLES)


def rank_position(states: list, rank: int) -> tuple[ShardPlan, int, int]:
    """The plan of ``rank`` resumed on the saved world size, the batches it took and the epoch it stands in;
    raises as ``load_state_dict`` does for a state a resume refuses."""
    state, world = states[rank], len(states)
    plan, finished = _shard(state, world, rank)
    if finished:  # the finished epoch, from its start, every batch taken (``_stand_at_finished_epoch``)
        epoch = _finished_epoch(state)
        plan = shard_plan(striped_settings(state[S.CONFIG], {**state, S.EPOCH: epoch}), world, rank, 0)
        return plan, plan.num_batches, epoch
    return plan, plan.steps_for(state[S.SAMPLES_CONSUMED]), state[S.EPOCH]


def _finished_epoch(state: Mapping[str, Any]) -> int:
    """The epoch whose last batch a checkpoint follows: its pass's (the state already names the next one), or
    for an earlier release's record of the last step, the state's own."""
    entry = state.get(PASS)
    return state[S.EPOCH] if entry is None else entry["origin"]["epoch"]


def rank_batches(state: Mapping[str, Any], plan: ShardPlan, epoch: int, start: int,
                 stop: Optional[int]) -> list[list[int]]:
    """The batches ``start`` to ``stop`` (exclusive; ``None``: the epoch's end) of ``plan`` in ``epoch``, as
    dataset indices."""
    order = _checked_order(state)
    if epoch != state[S.EPOCH]:
        order = _ORDERS[state[S.CONFIG]["order"]](state[S.CONFIG]["num_samples"], state[S.SEED], epoch)
    for first, last in reversed(of_epoch(state.get(S.SKIPPED, []), epoch)):
        del order[first:last]
    stop = plan.num_batches if stop is None else min(stop, plan.num_batches)
    return [[order[p] for p in plan.batch_positions(k)] for k in range(start, stop)]


def _checked_order(state: Mapping[str, Any]) -> list[int]:
    """The order of the state's epoch, refused as a resume refuses it when the saved fingerprint names
    another."""
    config, epoch = state[S.CONFIG], state[S.EPOCH]
    order = _ORDERS[config["order"]](config["num_samples"], state[S.SEED], epoch)
    saved = state.get(S.ORDER_FINGERPRINT)
    if saved is not None:
        current = hashlib.sha256(struct.pack(f"<{len(order)}q", *order)).hexdigest()[:16]
        if current != saved:
            _refusals.order_changed(epoch, saved, current, config["order"])
    return order

