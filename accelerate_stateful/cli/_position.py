"""A map-style loader's position, from its saved states alone, without torch (``inspect`` and ``verify``).

A shard (or dispatcher) state records everything its position means: batch size, dataset length, seed,
``drop_last``, ``even_batches``, ``split_batches``, world size and rank. Its batches follow from the pure plan
and position check the shard loader itself uses (``position._saved``) and the pass record's check
(``loaders._passes.check_entry``); the rest of ``validate_state`` (mode, settings, seed) and the
dispatcher's step count are restated here in a few lines. ``tests/test_cli_position.py`` holds every figure
and refusal against the loaders themselves, resumed from the same states, so a report cannot drift from a
resumed run. Which dataset indices a batch holds is ``samples``' question (``_indices``, ``_dispatched``).
"""

from __future__ import annotations

from typing import Any, Mapping

from ..checkpoint import _state as S
from ..checkpoint import _refusals
from ..errors import CheckpointError, Mismatch, UnsupportedConfigError
from ..loaders._passes import PASS, check_entry
from ..position._plan import ShardPlan
from ..position._saved import check_shard_position, shard_plan, striped_settings

# Every loader kind this release writes, by the mode its state records, and the name the tool shows.
KINDS = {
    S.SHARD_MODE: "shard",
    S.DISPATCH_MODE: "dispatcher",
    S.STREAM_MODE: "stream",
    S.ROUND_ROBIN_MODE: "round-robin",
    S.BATCH_SAMPLER_MODE: "batch-sampler",
}
_INTS = ("batch_size", "dataset_length", "num_samples")
_FLAGS = ("drop_last", "even_batches", "split_batches")


def is_map_style(state: Mapping[str, Any]) -> bool:
    """Whether the state is of a loader over a map-style dataset (each rank's shard, or the dispatcher's)."""
    if state[S.MODE] == S.SHARD_MODE:
        return True
    base = state.get(S.BASE)
    reads_map = isinstance(base, Mapping) and base.get(S.MODE) == S.SHARD_MODE
    return state[S.MODE] == S.DISPATCH_MODE and reads_map


def with_reader(states: list, rank: int) -> Mapping[str, Any]:
    """``rank``'s state; a dispatcher's with the main process's reader, which that rank receives from it."""
    own = states[rank]
    if own[S.MODE] == S.DISPATCH_MODE and states[0] is not None:
        own = {**own, S.BASE: states[0][S.BASE]}
    return own


def map_position(states: list, rank: int) -> dict:
    """``batches_in_epoch`` and ``epoch_fraction`` of ``rank`` resumed on the saved world size, as its loader
    reports them (``len()``, ``progress()``); raises as ``load_state_dict`` would for a state it refuses.

    A checkpoint taken right after an epoch's last batch is described as that epoch, every batch taken.
    """
    state, world = with_reader(states, rank), len(states)
    if state[S.MODE] == S.SHARD_MODE:
        plan, finished = _shard(state, world, rank)
        consumed = state[S.SAMPLES_CONSUMED]
        if finished:  # the finished epoch, from its start, every batch taken
            plan = shard_plan(striped_settings(state[S.CONFIG], state), world, rank, 0)
            consumed = plan.samples_consumed(plan.num_batches)
        fraction = consumed / plan.num_samples if plan.num_samples else None
        return {"batches_in_epoch": plan.num_batches, "epoch_fraction": fraction}
    length, steps = _dispatcher(state, world, rank)
    return {"batches_in_epoch": length, "epoch_fraction": min(steps / length, 1.0) if length else None}


# --------------------------------------------------------------------------- shard
def _check_settings(config: Mapping[str, Any], world: int) -> None:
    """The saved settings a loader is built from, refused where the loader could not be built."""
    valid = (all(isinstance(config.get(k), int) and not isinstance(config.get(k), bool) for k in _INTS)
             and all(isinstance(config.get(k), bool) for k in _FLAGS) and isinstance(config.get("order"), str)
             and config["batch_size"] >= 1 and config["num_samples"] >= 0)
    if not valid:
        raise CheckpointError(
            f"the saved loader settings {dict(config)!r} are incomplete or invalid; the file is damaged or was "
            "edited by hand"
        )
    if config["split_batches"] and config["batch_size"] % world != 0:
        raise UnsupportedConfigError(
            f"split_batches=True needs a batch_size divisible by the number of processes: "
            f"batch_size={config['batch_size']}, processes={world}; change one of them"
        )


def _check_shard(state: Any, config: Mapping[str, Any], seed: tuple, world: int, rank: int) -> None:
    """What ``ShardDataLoader.validate_state`` refuses, the loader built with ``config`` and ``(seed, source)``."""
    S.check_shape(state)
    mismatches = [Mismatch(S.MODE, state[S.MODE], S.SHARD_MODE)] if state[S.MODE] != S.SHARD_MODE else []
    seed_mismatch, _, _ = S.resolve_seed(state, *seed)
    _refusals.raise_mismatches(mismatches + S.config_mismatches(state[S.CONFIG], config) + _listed(seed_mismatch))
    check_shard_position(striped_settings(config, state), state, world, rank, "")
    mark = check_entry(state, "")
    if mark is not None:
        _check_shard(mark, config, seed, world, rank)


def _listed(mismatch: Any) -> list:
    return [] if mismatch is None else [mismatch]


def _shard(state: Mapping[str, Any], world: int, rank: int) -> tuple[ShardPlan, bool]:
    """The plan of a shard loader resumed from ``state``, and whether it stands between two epochs (a finished
    pass, or an earlier release's record of an epoch's last step)."""
    config = state[S.CONFIG]
    _check_settings(config, world)
    _check_shard(state, config, (state[S.SEED], state[S.SEED_SOURCE]), world, rank)
    plan = shard_plan(striped_settings(config, state), world, rank, state.get(S.STRIPE_ORIGIN, 0))
    entry = state.get(PASS)
    if entry is None:
        return plan, plan.num_steps > 0 and state[S.SAMPLES_CONSUMED] >= plan.samples_consumed(plan.num_steps)
    return plan, bool(entry.get("complete", False))


# --------------------------------------------------------------------------- dispatcher
def _dispatcher(state: Mapping[str, Any], world: int, rank: int) -> tuple[int, int]:
    """(steps in the epoch, steps taken) of a dispatcher resumed from ``state`` (with the main process's reader)."""
    base = state.get(S.BASE)
    if not isinstance(base, Mapping):
        raise UnsupportedConfigError(
            f"cannot resume: the main process's state has no reader state under '{S.BASE}'; the file is damaged "
            "or belongs to another rank, resume from another checkpoint"
        )
    reader_length = _shard(base, 1, 0)[0].num_batches
    config = state[S.CONFIG]
    split, drop_last = config.get("split_batches", False), config.get("drop_last", False)
    if split and base[S.CONFIG]["batch_size"] % world != 0:
        raise UnsupportedConfigError(
            f"split_batches=True needs a batch_size divisible by the number of processes: "
            f"batch_size={base[S.CONFIG]['batch_size']}, processes={world}; change one of them"
        )
    _check_dispatcher(state, config, base, world, rank)
    group = 1 if split else world
    read, steps_before = _step_origin(state)
    steps = state[S.BATCHES_YIELDED]
    length = steps_before + _steps_for(reader_length - read, group, drop_last)
    complete = state[PASS].get("complete", False) if state.get(PASS) is not None else length > 0 and steps >= length
    if complete:  # the finished epoch, from its start, every step taken
        length = _steps_for(shard_plan(striped_settings(base[S.CONFIG], base), 1, 0, 0).num_batches, group, drop_last)
        steps = length
    return length, steps


def _check_dispatcher(state: Any, config: Mapping[str, Any], base: Mapping[str, Any], world: int,
                      rank: int) -> None:
    """What ``DispatchDataLoader.validate_state`` refuses, the dispatcher built with the settings ``config`` over
    a reader built from the main process's reader state ``base``."""
    S.check_shape(state)
    reader_config, seed = base[S.CONFIG], (base[S.SEED], base[S.SEED_SOURCE])
    own = {**reader_config, "split_batches": config.get("split_batches", False),
           "drop_last": config.get("drop_last", False)}
    mismatches = [Mismatch(S.MODE, state[S.MODE], S.DISPATCH_MODE)] if state[S.MODE] != S.DISPATCH_MODE else []
    seed_mismatch, _, _ = S.resolve_seed(state, *seed)
    _refusals.raise_mismatches(mismatches + S.config_mismatches(state[S.CONFIG], own) + _listed(seed_mismatch))
    saved = state[S.TOPOLOGY]
    if saved.get("world_size") == world and saved.get("rank") != rank:
        raise UnsupportedConfigError(
            f"cannot resume: the state belongs to rank {saved.get('rank')}, this is rank {rank}; load each "
            "rank's own state"
        )
    if own["split_batches"] and reader_config["batch_size"] % saved.get("world_size", 1) != 0:
        raise UnsupportedConfigError(
            f"cannot resume: invalid topology {saved!r}; the state is damaged, resume from another checkpoint"
        )
    reader = state.get(S.BASE)
    if not isinstance(reader, Mapping):
        raise UnsupportedConfigError(
            f"cannot resume: the main process's state has no reader state under '{S.BASE}'; the file is damaged "
            "or belongs to another rank, resume from another checkpoint"
        )
    _check_shard(reader, reader_config, seed, 1, 0)
    mark = check_entry(state, "")
    if mark is not None:
        _check_dispatcher(mark, config, base, world, rank)


def _step_origin(state: Mapping[str, Any]) -> tuple[int, int]:
    origin = state.get(S.STEP_ORIGIN) or (0, 0)
    return int(origin[0]), int(origin[1])


def _steps_for(reader_batches: int, group: int, drop_last: bool) -> int:
    return reader_batches // group if drop_last else -(-reader_batches // group)

