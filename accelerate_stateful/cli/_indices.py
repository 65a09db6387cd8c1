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

On another number of processes (``--world-size``) the ranks' states are merged as a resume merges them
(``_compare.merged_state``, refused alike where the ranks were not in step), and the rest of the epoch is
striped over the new ranks as the shard loader's restore stripes it. A dispatcher's batches are runs of the same
orders (``_dispatched``). Everything else (a ``DistributedSampler``'s order, a very long epoch, where importing
torch costs less than drawing the order here) goes to the loaders themselves (``_loaders``).
"""

from __future__ import annotations

import hashlib
import random
import struct
from typing import Any, Mapping, Optional

from ..checkpoint import _refusals
from ..checkpoint import _state as S
from ..checkpoint._compare import merged_state
from ..loaders._passes import PASS
from ..position._plan import ShardPlan
from ..position._saved import shard_plan, striped_settings
from ..position._seeds import mix_seed
from ..position._skips import of_epoch
from ._position import _shard

# Above this many samples, importing torch and drawing its randperm is faster than the shuffle with numpy.
MAX_SAMPLES = 4_000_000
# The longest epoch :func:`randperm` draws as torch does: from (2**32 - 1) // 20 samples on, torch's randperm
# draws 64-bit numbers.
MAX_DRAWN = 0xFFFFFFFF // 20 - 1
# Above this many, importing numpy and shuffling with it is faster than the loop in Python (about 0.7 µs a
# sample): the two are even at about 200,000 (benchmarks/bench_samples.py).
PYTHON_SHUFFLE = 250_000


def randperm(n: int, seed: int) -> list[int]:
    """``torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()``, without torch."""
    if n > PYTHON_SHUFFLE:
        try:
            return _randperm_numpy(n, seed)
        except ImportError:  # numpy ships with torch's wheels, yet torch does not require it
            pass
    engine = random.Random()
    engine.setstate((3, (*_mt19937_state(seed & 0xFFFFFFFF), 624), None))
    bits, order = engine.getrandbits, list(range(n))
    for i in range(n - 1):
        z = i + bits(32) % (n - i)
        order[i], order[z] = order[z], order[i]
    return order


def _randperm_numpy(n: int, seed: int) -> list[int]:
    """:func:`randperm` without its loop: the same swaps, resolved as a whole with numpy.

    Step ``i`` of the shuffle swaps positions ``i`` and ``z[i] >= i``; position ``i`` is final after it. Let
    ``w[p]`` be the value position ``p`` holds just before step ``p``. Only steps ``k < p`` with ``z[k] == p``
    wrote position ``p`` before then, each putting there ``w[k]``, so ``w[p] = w[k]`` for the last of them,
    and ``p`` where there is none: a forest whose roots are the values, resolved by pointer doubling. Step
    ``i`` then takes the value of position ``z[i]``: ``w[i]`` for a swap with itself, else what the last
    earlier step with the same ``z`` left there (``w`` of that step), else the untouched ``z[i]``. The last
    position, which no step moves, is a swap with itself.
    """
    import numpy as np

    if n < 2:
        return list(range(n))
    engine = np.random.MT19937()
    engine.state = {"bit_generator": "MT19937",
                    "state": {"key": np.array(_mt19937_state(seed & 0xFFFFFFFF), dtype=np.uint32), "pos": 624}}
    steps = np.arange(n, dtype=np.int64)
    z = steps.copy()  # n is below 2**32 (MAX_DRAWN), as each draw is: 32-bit division is the cheaper
    z[:-1] += engine.random_raw(n - 1).astype(np.uint32) % np.arange(n, 1, -1, dtype=np.uint32)
    # The steps grouped by the position they swap with, each group in step order: one sort of one key.
    key = np.sort((z << 32) | steps)
    by_z, grouped = key >> 32, key & 0xFFFFFFFF
    same = by_z[1:] == by_z[:-1]
    before = np.full(n, -1, dtype=np.int64)  # the previous step swapping with the same position
    before[grouped[1:][same]] = grouped[:-1][same]
    ends = np.append(~same, True)
    last = np.full(n, -1, dtype=np.int64)  # the last step swapping with each position
    last[by_z[ends]] = grouped[ends]
    writer = np.where(last == steps, before, last)  # the last step before p that wrote position p
    root = np.where(writer >= 0, writer, steps)
    while True:
        up = root[root]
        if np.array_equal(up, root):
            break
        root = up
    taken = np.where(before >= 0, root[np.maximum(before, 0)], z)
    return np.where(z == steps, root, taken).tolist()


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


def answerable(states: list, rank: int, world: int, limit: Optional[int] = None) -> bool:
    """Whether :func:`rank_position` and :func:`rank_batches` answer for ``rank`` of ``world`` (else the loaders do):
    on the saved world size from the rank's own state, on another from every rank's (merged); an epoch of up to
    ``limit`` samples (default :data:`MAX_SAMPLES`, read at the call)."""
    limit = MAX_SAMPLES if limit is None else limit
    for state in [states[rank]] if len(states) == world else states:
        if not isinstance(state, Mapping) or state.get(S.MODE) != S.SHARD_MODE or S.ORDER_WORLD in state:
            return False
        config = state.get(S.CONFIG)
        if not (isinstance(config, Mapping) and config.get("order") in _ORDERS
                and isinstance(config.get("num_samples"), int) and 0 <= config["num_samples"] <= limit):
            return False
    return True


def resumed_state(states: list, rank: int, world: int) -> Mapping[str, Any]:
    """The state ``rank`` of ``world`` resumes from, as ``load_state`` gives it: its own on the saved world size,
    else every saved rank's merged (refused as that resume refuses it where the ranks were not in step)."""
    return states[rank] if len(states) == world else merged_state(states)


def rank_position(state: Mapping[str, Any], rank: int, world: int) -> tuple[ShardPlan, int, int]:
    """The plan of ``rank`` of ``world`` resumed from ``state`` (:func:`resumed_state`), the batches it took and
    the epoch it stands in; raises as ``load_state_dict`` does for a state a resume refuses."""
    plan, finished = _shard(state, world, rank)
    if finished:  # the finished epoch, from its start, every batch taken (``_stand_at_finished_epoch``)
        epoch = _finished_epoch(state)
        plan = shard_plan(striped_settings(state[S.CONFIG], {**state, S.EPOCH: epoch}), world, rank, 0)
        return plan, plan.num_batches, epoch
    if state[S.TOPOLOGY]["world_size"] != world:
        # Another number of processes: the rest of the epoch, from the first sample nobody took, striped over the
        # new ranks (``ShardDataLoader._restore``).
        plan = shard_plan(striped_settings(state[S.CONFIG], state), world, rank, state[S.SAMPLES_CONSUMED])
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
    order = epoch_order(state, epoch)
    stop = plan.num_batches if stop is None else min(stop, plan.num_batches)
    return [[order[p] for p in plan.batch_positions(k)] for k in range(start, stop)]


def epoch_order(state: Mapping[str, Any], epoch: int) -> list[int]:
    """The dataset indices at the positions of ``epoch``'s order, less the samples left out of it
    (``skip_samples``), as a plan of the state's settings numbers them."""
    order = _checked_order(state)
    if epoch != state[S.EPOCH]:
        order = _ORDERS[state[S.CONFIG]["order"]](state[S.CONFIG]["num_samples"], state[S.SEED], epoch)
    for first, last in reversed(of_epoch(state.get(S.SKIPPED, []), epoch)):
        del order[first:last]
    return order


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

