"""What a saved shard position means, from its state alone.

Pure: the shard loader plans its epochs with :func:`shard_plan` and checks a state it loads with
:func:`check_saved_topology` and :func:`check_saved_steps` (between them it checks the epoch's order, which
for a user's ``DistributedSampler`` depends on the number of processes); the command line
(``accelerate-stateful inspect``/``verify``) reads checkpoints with :func:`check_shard_position`, the same
checks, without torch.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ..checkpoint import _state as S
from ..errors import UnsupportedConfigError
from ._plan import ShardPlan
from ._skips import check_saved, count


def shard_plan(config: Mapping[str, Any], world: int, rank: int, origin: int) -> ShardPlan:
    """The plan of ``rank`` of ``world`` from ``origin`` for a shard loader with the settings ``config``.

    ``config`` holds the saved settings (:class:`~accelerate_stateful.checkpoint._state.LoaderConfig`).
    """
    batch_size = config["batch_size"]
    return ShardPlan(
        num_samples=config["num_samples"],
        batch_size=batch_size // world if config["split_batches"] else batch_size,
        world_size=world,
        rank=rank,
        drop_last=config["drop_last"],
        # Accelerate does not shard on one process (it keeps the user's batch sampler), so it never pads the
        # last batch there.
        even_batches=config["even_batches"] and world > 1,
        origin=origin,
    )


def order_length(plan_for: Callable[[int, int, int], ShardPlan], world_size: int, share: int) -> int:
    """How many entries a ``DistributedSampler``'s global order at ``world_size`` has (``position._distributed``),
    each rank's share being ``share`` long and ``plan_for(world, rank, num_samples)`` striping it."""
    plans = [plan_for(world_size, r, share) for r in range(world_size)]
    return sum(len(plan.batch_positions(step)) for plan in plans for step in range(plan.num_batches))


def striped_settings(config: Mapping[str, Any], state: Mapping[str, Any]) -> Mapping[str, Any]:
    """The settings a saved position is striped with: ``config``, but for a user's ``DistributedSampler``
    (``order_world_size`` in the state) the length of its global order at the world size that began the epoch,
    and without the samples of the state's epoch left out (``skip_samples``)."""
    skipped = count(check_saved(state.get(S.SKIPPED, []), ""), state[S.EPOCH])
    world = state.get(S.ORDER_WORLD)
    if world is None:
        return {**config, "num_samples": config["num_samples"] - skipped} if skipped else config
    length = order_length(lambda w, r, n: shard_plan({**config, "num_samples": n}, w, r, 0), world,
                          config["num_samples"])
    return {**config, "num_samples": length - skipped}


def check_shard_position(config: Mapping[str, Any], state: Mapping[str, Any], world: int, rank: int,
                         source: str) -> None:
    """Raise unless ``state``'s position can be continued by ``rank`` of ``world`` with the settings ``config``."""
    saved_world, saved_rank = check_saved_topology(config, state, world, rank, source)
    origin = state.get(S.STRIPE_ORIGIN, 0)
    check_saved_steps(lambda: shard_plan(config, saved_world, saved_rank, origin), state[S.SAMPLES_CONSUMED], state,
                      source)


def check_saved_topology(config: Mapping[str, Any], state: Mapping[str, Any], world: int, rank: int,
                         source: str) -> tuple[int, int]:
    """The saved ``(world size, rank)``, once they, the batch settings and the position's counters are valid."""
    saved = state[S.TOPOLOGY]
    where = f" in {source}" if source else ""
    saved_world, saved_rank = saved.get("world_size"), saved.get("rank")
    if not (isinstance(saved_world, int) and isinstance(saved_rank, int) and 0 <= saved_rank < saved_world):
        raise UnsupportedConfigError(
            f"cannot resume{where}: invalid topology {saved!r}; the state is damaged, resume from another checkpoint"
        )
    if saved_world == world and saved_rank != rank:
        raise UnsupportedConfigError(
            f"cannot resume{where}: the state belongs to rank {saved_rank}, this is rank {rank}; "
            "load each rank's own state"
        )
    if config["split_batches"] and config["batch_size"] % saved_world != 0:
        raise UnsupportedConfigError(f"cannot resume{where}: batch_size is not divisible by {saved_world} processes")
    consumed, origin = state.get(S.SAMPLES_CONSUMED), state.get(S.STRIPE_ORIGIN, 0)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (consumed, origin)):
        raise UnsupportedConfigError(
            f"cannot resume{where}: '{S.SAMPLES_CONSUMED}'={consumed!r} and '{S.STRIPE_ORIGIN}'={origin!r} must "
            "be integers, none negative; the state is damaged or was edited by hand, resume from another "
            "checkpoint"
        )
    return saved_world, saved_rank


def check_saved_steps(plan: Callable[[], ShardPlan], consumed: int, state: Mapping[str, Any], source: str) -> None:
    """Raise unless ``consumed`` samples are, on the saving rank's ``plan`` (made here: a plan that cannot be made
    is a damaged position too), the batches the state says it took."""
    where = f" in {source}" if source else ""
    try:
        steps = plan().steps_for(consumed)
    except ValueError as exc:
        raise UnsupportedConfigError(
            f"cannot resume{where}: inconsistent position ({exc}); the state is damaged or was edited "
            "by hand, resume from another checkpoint"
        ) from None
    if steps != state[S.BATCHES_YIELDED]:
        raise UnsupportedConfigError(
            f"cannot resume{where}: inconsistent position: samples_consumed={consumed} means {steps} batches "
            f"on rank {state[S.TOPOLOGY]['rank']}, but batches_yielded={state[S.BATCHES_YIELDED]}; the state is "
            "damaged or was edited by hand, resume from another checkpoint"
        )
