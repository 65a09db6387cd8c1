"""Refusals in the user's terms: what changed since the run that saved, and how to fix it.

A saved loader state records the settings its position is only meaningful for (``config``); a
mismatch is reported with the setting's name as the user wrote it (``DataLoader(batch_size=...)``,
``len(dataset)``, the sampler) and the fix, never as the state's internal key alone. Two changes get
their own diagnosis, because the field-by-field list would point at the wrong fix:

- loaders prepared in another order than in the run that saved (every saved state fits one of this
  run's loaders, just not the one at its index);
- a sampler whose length depends on the number of processes (a ``DistributedSampler``) resumed on
  another number of processes.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

from . import _state as S
from ..errors import CheckpointError, Mismatch, StatefulLoaderError, StateMismatchError, UnsupportedConfigError

# The setting behind each field of a loader state's ``config`` (and its mode and seed), as the user sets it.
SETTINGS = {
    "dataset_length": "len(dataset)",
    "num_samples": "samples per epoch (len(sampler))",
    "order": "shuffle/sampler (the epoch order)",
    "dataset": "dataset class",
    "source": "round-robin source class",
    "sliced_per_rank": "slicing of one whole stream over the processes",
    S.MODE: "way the loader is read (dispatch_batches; map-style or iterable dataset)",
    S.SEED: "data seed (DataLoaderConfiguration(data_seed=...) or the DataLoader's generator seed)",
    S.ORDER_FINGERPRINT: "the sampler's order of the saved epoch (a fingerprint of its indices)",
}


def setting(field: str) -> str:
    """The user's name for a state field (the field itself when it has no other)."""
    return SETTINGS.get(field, field)


def raise_mismatches(mismatches: list[Mismatch], source: str = "") -> None:
    """Raise one ``StateMismatchError`` listing every setting that changed, in the user's terms."""
    if mismatches:
        names = ", ".join(setting(m.field) for m in mismatches)
        raise StateMismatchError(
            mismatches,
            fix=f"use the same {names} as the run that wrote the checkpoint, or start a fresh run",
            source=source,
            label=setting,
        )


def world_dependent_sampler(state: Mapping[str, Any], config: Mapping[str, Any], world_size: int) -> Optional[str]:
    """The refusal for a sampler whose length changed with the number of processes, or ``None``."""
    saved_config, saved_world = state[S.CONFIG], state[S.TOPOLOGY].get("world_size")
    order = str(saved_config.get("order", ""))
    if saved_world == world_size or not order.startswith("sampler:"):
        return None
    if saved_config.get("num_samples") == config.get("num_samples"):
        return None
    if saved_config.get("dataset_length") != config.get("dataset_length"):
        return None
    name = order.split(":", 1)[1]
    return (
        f"this loader's sampler is a {name} whose length depends on the number of processes: it drew "
        f"{saved_config.get('num_samples')} samples per epoch on each of {saved_world} processes when the checkpoint "
        f"was written, and draws {config.get('num_samples')} on each of {world_size} now. Let Accelerate shard "
        f"the data (drop the {name} and pass shuffle=... to the DataLoader), or resume on {saved_world} processes"
    )


def order_refusal(
    states: Sequence[Mapping[str, Any]], fits: Callable[[int, int], bool], describe: Callable[[int], str],
    checkpoint: Any,
) -> Optional[CheckpointError]:
    """The refusal for loaders prepared in another order, when every saved state fits some other loader.

    Args:
        states: The saved state of each loader, by the index it was saved at.
        fits: ``fits(saved, current)``: whether saved state ``saved`` can be loaded into this run's loader ``current``.
        describe: The user's description of this run's loader ``current``.
        checkpoint: The checkpoint folder, for the message.
    """
    count = len(states)
    if count < 2 or all(fits(i, i) for i in range(count)):
        return None
    match = _permutation(count, fits)
    if match is None:
        return None
    lines = "; ".join(f"loader {i} was {describe(j)} (prepared as loader {j} now)" for i, j in enumerate(match))
    return CheckpointError(
        f"cannot resume from {checkpoint}: the loaders were prepared in another order than in the run that saved "
        f"it: {lines}. Prepare your loaders in the same order as that run (accelerator.prepare(...) order)"
    )


def _permutation(count: int, fits: Callable[[int, int], bool]) -> Optional[list[int]]:
    """A one-to-one ``saved -> current`` assignment where every pair fits (backtracking), or ``None``."""
    match: list[int] = []

    def place(i: int) -> bool:
        if i == count:
            return True
        for j in range(count):
            if j not in match and fits(i, j):
                match.append(j)
                if place(i + 1):
                    return True
                match.pop()
        return False

    return match if place(0) else None


def fits(loader: Any, state: Mapping[str, Any]) -> bool:
    """Whether ``state`` can be loaded into ``loader`` as it was saved (it raises nothing and changes nothing).

    A state of another batch size does not fit here, though many loaders resume it: two loaders that differ only
    by their batch size, prepared in the other order, would otherwise each continue the other's position.
    """
    try:
        loader.validate_state(state)
    except StatefulLoaderError:
        return False
    return loader._batch_change(state) is None


def uneven_batch_sizes(sizes: Sequence[Any], loader: Any, state: Mapping[str, Any], source: str) -> None:
    """Refuse, on each process whose batch size differs from the checkpoint's, a resume where the processes were
    given different batch sizes (``sizes``, by rank): the rest of the epoch is cut at one size for all."""
    change = loader._batch_change(state)
    if len(set(map(str, sizes))) < 2 or change is None:
        return
    given = ", ".join(f"rank {rank}: {size}" for rank, size in enumerate(sizes))
    raise StateMismatchError(
        [Mismatch("batch_size", *change)],
        fix=f"the processes were given different batch sizes ({given}); pass the same batch_size on every process "
            "(another one than the checkpoint's is resumed when every process has it)",
        source=source,
        label=setting,
    )


def describe(loader: Any) -> str:
    """A loader as the user built it: its dataset, batch size and sampler."""
    return _described(f"the {loader.mode} loader over {type(loader.dataset).__name__}", loader._config())


def describe_saved(state: Mapping[str, Any]) -> str:
    """The loader a saved state was written by, as far as the state tells: its kind, dataset size, batch size
    and order."""
    config = state.get(S.CONFIG)
    return _described(f"the {state.get(S.MODE)} loader", config if isinstance(config, Mapping) else {})


def _described(start: str, config: Mapping[str, Any]) -> str:
    parts = [start]
    if "dataset_length" in config:
        parts.append(f"of {config['dataset_length']} samples")
    if "batch_size" in config:
        parts.append(f"with batch_size={config['batch_size']}")
    if "order" in config:
        parts.append(f"and a {config['order']} order")
    return " ".join(parts)


def where(state: Mapping[str, Any]) -> str:
    """A saved position in words, for a message."""
    taken = state.get(S.SAMPLES_CONSUMED)
    samples = f", {taken} samples taken by all processes" if taken is not None else ""
    return f"epoch {state.get(S.EPOCH)}{samples}"


def order_changed(epoch: int, saved: str, current: str, kind: str, source: str = "") -> None:
    """Refuse a saved position whose epoch this run's sampler draws in another order."""
    name = kind.split(":", 1)[1] if kind.startswith("sampler:") else kind
    raise StateMismatchError(
        [Mismatch(S.ORDER_FINGERPRINT, saved, current)],
        fix=f"the sampler's order for epoch {epoch} ({name}) differs from the one saved (seed changed?), so the "
            "saved position would land on other samples; restore the same sampler seed (and sampler) as the run "
            "that wrote the checkpoint, or start a fresh run",
        source=source,
        label=setting,
    )


def legacy_order(sampler: Any, skip: Sequence[Any], legacy_paths: Sequence[str], source: str = "") -> None:
    """Refuse a state written before orders had fingerprints when this release draws its sampler differently.

    Earlier releases seeded only the ``legacy_paths`` generators of a sampler; one holding other RNGs drew its
    order from their unseeded state, which no run can reproduce, so the saved position cannot be placed.
    """
    from ..position._sampler_rng import held_rngs

    extra = [path.lstrip(".") for path, _ in held_rngs(sampler, skip) if path not in legacy_paths]
    if extra:
        where = f" ({source})" if source else ""
        raise UnsupportedConfigError(
            f"cannot resume{where}: the checkpoint was written by an earlier release, which did not seed the "
            f"random generator(s) {', '.join(extra)} of {type(sampler).__name__}, so the order its position "
            "refers to cannot be drawn again; start a fresh run (this release records and reproduces it)"
        )
