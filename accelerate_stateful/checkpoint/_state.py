"""The typed, versioned loader state and its validation.

A loader state is a plain dict (see :class:`LoaderState`): our own keys for
the position and the topology it was written with, plus the base loader's
own state nested untouched under ``"base"``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, TypedDict

from ._versions import refuse_unknown_version
from ..errors import Mismatch, UnsupportedConfigError

FORMAT_VERSION = 1
SUPPORTED_FORMAT_VERSIONS = (1,)

# Key constants: the only spelling of each key in the package.
VERSION = "format_version"
MODE = "mode"
EPOCH = "epoch"
SAMPLES_CONSUMED = "samples_consumed"
STRIPE_ORIGIN = "stripe_origin"
BATCHES_YIELDED = "batches_yielded"
TOPOLOGY = "topology"
CONFIG = "config"
SEED = "seed"
SEED_SOURCE = "seed_source"
YIELDING_SOURCES = ("drawn", "initial_seed")  # seed sources not chosen for the data: a checkpoint's seed wins
BASE = "base"
ORDER_FINGERPRINT = "order_fingerprint"  # a digest of the epoch's order (map-style loaders; optional: older states lack it)
ORDER_WORLD = "order_world_size"  # the world size whose DistributedSampler shares make the epoch's order
ORDER_BATCH = "order_batch_size"  # with ORDER_WORLD: the batch size those shares were striped with, if not config's
STREAM = "stream"  # a stream loader's own position (``loaders.iterable``)
SOURCE = "source"  # a round-robin loader's source position (``sources.roundrobin``)
SKIPPED = "skipped_samples"  # ranges [epoch, start, stop] of an epoch's order left out (``position._skips``)
STEP_ORIGIN = "step_origin"  # a dispatcher's (reader batches, steps) where its epoch's steps of its size began
FIRST_SAMPLES = "first_samples"  # a dispatcher's first samples of the epoch, which complete its last step

# The loader kinds, by the ``mode`` their state records (each class's ``mode``).
SHARD_MODE = "shard"
DISPATCH_MODE = "dispatch"
STREAM_MODE = "iterable-shard"
ROUND_ROBIN_MODE = "round-robin"
BATCH_SAMPLER_MODE = "batch-sampler"


class Topology(TypedDict):
    """Where the state was written: ``world_size``, ``rank``, ``num_workers``."""

    world_size: int
    rank: int
    num_workers: int


class LoaderConfig(TypedDict):
    """The loader settings a position is only meaningful for."""

    batch_size: int
    dataset_length: int
    num_samples: int
    drop_last: bool
    even_batches: bool
    split_batches: bool
    order: str


class LoaderState(TypedDict):
    """A loader's complete, versioned state.

    State dict:
        format_version: ``FORMAT_VERSION`` of the writer.
        mode: ``"shard"`` (each rank reads its own share).
        epoch: The epoch the position is in.
        samples_consumed: Global positions of the epoch taken by all ranks together.
        stripe_origin: Where the epoch's current striping over ranks began (0 unless
            the epoch was continued on another world size).
        batches_yielded: This rank's batches handed to the training loop in the epoch
            (derived from ``samples_consumed``; kept for progress bars and checking).
        seed: The seed every epoch's order is drawn from.
        seed_source: ``"data_seed"``, ``"generator"``, ``"initial_seed"`` (``set_seed``'s, with
            ``use_seedable_sampler``) or ``"drawn"``; only the last two may be replaced by a checkpoint's.
        topology: :class:`Topology` at save time.
        config: :class:`LoaderConfig` at save time.
        base: The base loader's own state, untouched (``None`` for a plain ``DataLoader``).
        order_fingerprint: A digest of the epoch's order (shard and batch-sampler loaders; states written
            before it existed lack it). A resume whose order for that epoch differs is refused.
        order_world_size: Only with a user's ``DistributedSampler``: the number of processes whose shares
            make the epoch's order (the world size the epoch began on).
        order_batch_size: With ``order_world_size``, when the batch size changed since the epoch began: the batch
            size whose steps make the epoch's order.
        skipped_samples: Map-style loaders: the ranges ``[epoch, start, stop]`` of positions of an epoch's order
            that ``skip_samples`` left out (absent in states written before it existed: none).
    """

    format_version: int
    mode: str
    epoch: int
    samples_consumed: int
    stripe_origin: int
    batches_yielded: int
    seed: int
    seed_source: str
    topology: Topology
    config: LoaderConfig
    base: Optional[Any]


_REQUIRED = {
    VERSION: int,
    MODE: str,
    EPOCH: int,
    BATCHES_YIELDED: int,
    SEED: int,
    SEED_SOURCE: str,
    TOPOLOGY: dict,
    CONFIG: dict,
}


def check_shape(state: Mapping[str, Any], source: str = "") -> None:
    """Refuse a state that is not a loader state of a format this package reads."""
    where = f" in {source}" if source else ""
    if not isinstance(state, Mapping):
        raise UnsupportedConfigError(f"a loader state must be a dict, got {type(state).__name__}{where}")
    version = state.get(VERSION)
    if not isinstance(version, int) or isinstance(version, bool):
        raise UnsupportedConfigError(
            f"not an accelerate-stateful loader state{where}: no integer '{VERSION}' key; "
            "load a state written by this package's state_dict() or save_state()"
        )
    refuse_unknown_version(VERSION, version, SUPPORTED_FORMAT_VERSIONS, f"loader state{where}",
                           error=UnsupportedConfigError)
    for key, kind in _REQUIRED.items():
        value = state.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise UnsupportedConfigError(
                f"loader state{where} has an invalid '{key}': {value!r} (expected {kind.__name__}); "
                "the file is damaged or was edited by hand, resume from another checkpoint"
            )
    for key in (EPOCH, BATCHES_YIELDED):
        if state[key] < 0:
            raise UnsupportedConfigError(
                f"loader state{where} has a negative '{key}': {state[key]}; "
                "the file is damaged or was edited by hand, resume from another checkpoint"
            )


# Config keys older states carry that no longer decide anything (how a stream is read is now its "reading").
RETIRED_CONFIG_KEYS = frozenset({"sliced_per_rank"})


def config_mismatches(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[Mismatch]:
    """Every config field on which ``saved`` and ``current`` differ, in key order (retired keys ignored)."""
    keys = sorted((set(saved) | set(current)) - RETIRED_CONFIG_KEYS)
    return [Mismatch(k, saved.get(k), current.get(k)) for k in keys if saved.get(k) != current.get(k)]


def resolve_seed(saved: Mapping[str, Any], seed: int, seed_source: str) -> tuple[Optional[Mismatch], int, str]:
    """The seed to continue with, or the mismatch if both seeds were chosen explicitly.

    A seed this run drew at random yields to the checkpoint's; a seed the user
    chose (``data_seed`` or a seeded generator) must match it.
    """
    saved_seed = saved[SEED]
    if saved_seed == seed:
        return None, seed, seed_source
    if seed_source in YIELDING_SOURCES:
        return None, saved_seed, saved[SEED_SOURCE]
    return Mismatch(SEED, saved_seed, seed), seed, seed_source
