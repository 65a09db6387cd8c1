"""The randomness a user's sampler holds, reseeded per epoch; and a fingerprint of each epoch's order.

A sampler's order is reproduced by drawing it under RNGs seeded from (seed, epoch) (``_order``). The
global RNGs are seeded there; this module reaches the RNGs the sampler keeps itself, under any attribute
name: a ``torch.Generator``, a ``random.Random``, a ``numpy`` ``Generator`` or ``RandomState``, held
directly (``self.rng``), in a list, tuple or dict (``self.rngs[1]``), or by an object the sampler holds
(a wrapped sampler, a small helper object). The walk is deterministic: the attribute ``generator`` first
(the name torch's samplers use), then the other attributes in sorted order, containers in their order
(dicts by sorted key). Each RNG is seeded from (seed, epoch) and its path, so two RNGs never share a
stream; ``generator`` keeps the seed earlier releases gave it, so an old checkpoint's order is unchanged.

What the walk cannot reach (an RNG inside a closure or a C extension) leaves the order different from one
draw to the next: ``drawn_twice`` catches that at the first epoch, and the fingerprint of each epoch's
order, recorded in the loader state, catches a resume whose order differs from the saved one (a seed
changed between the runs).
"""

from __future__ import annotations

import hashlib
import random
import zlib
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.data import Dataset

from ._seeds import mix_seed

try:  # numpy is optional for torch
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with every supported torch install
    np = None

_ATOMS = (int, float, bool, str, bytes, type(None), torch.Tensor)
_MAX_DEPTH = 4
LEGACY_PATHS = (".generator", ".sampler.generator")  # what earlier releases seeded (with mix_seed(seed, epoch))
_RNG_TYPES: tuple = (torch.Generator, random.Random) + (
    (np.random.Generator, np.random.RandomState) if np is not None else ()
)


def held_rngs(sampler: Any, skip: Sequence[Any] = ()) -> list[tuple[str, Any]]:
    """Every RNG ``sampler`` holds, as ``(path, rng)``, in the walk's order (each object once).

    Args:
        sampler: The user's sampler (or batch sampler).
        skip: Objects not to walk into (the loader's dataset: its RNGs are not the sampler's).
    """
    found: list[tuple[str, Any]] = []
    seen = {id(item) for item in skip}
    _walk(sampler, "", 0, seen, found)
    return found


def _walk(obj: Any, path: str, depth: int, seen: set, found: list) -> None:
    if isinstance(obj, _ATOMS) or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, _RNG_TYPES):
        found.append((path, obj))
        return
    if depth >= _MAX_DEPTH or isinstance(obj, torch.nn.Module) or (depth and isinstance(obj, Dataset)):
        return
    for name, child in _children(obj):
        _walk(child, f"{path}{name}", depth + 1, seen, found)


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, (list, tuple)):
        if obj and all(isinstance(item, _ATOMS) for item in obj[:64]) and _all_atoms(obj):
            return  # a list of numbers (indices, lengths): nothing to reach, skipped in one pass
        yield from ((f"[{i}]", item) for i, item in enumerate(obj))
    elif isinstance(obj, dict):
        yield from ((f"[{key!r}]", obj[key]) for key in sorted(obj, key=repr))
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        attributes = vars(obj)
        names = sorted(attributes, key=lambda name: (name != "generator", name))
        yield from ((f".{name}", attributes[name]) for name in names)


def _all_atoms(items: Sequence[Any]) -> bool:
    return all(type(item) in (int, float, bool, str) for item in items)


def reseed(sampler: Any, seed: int, epoch: int, skip: Sequence[Any] = ()) -> int:
    """Seed every RNG ``sampler`` holds from (seed, epoch, its path); returns how many were seeded."""
    rngs = held_rngs(sampler, skip)
    for path, rng in rngs:
        _seed(rng, rng_seed(path, seed, epoch))
    return len(rngs)


def rng_seed(path: str, seed: int, epoch: int) -> int:
    """The seed of the RNG at ``path`` for (seed, epoch): ``.generator`` keeps the seed of earlier releases."""
    if path in LEGACY_PATHS:
        return mix_seed(seed, epoch)
    return mix_seed(seed, epoch, zlib.crc32(path.encode()))


def _seed(rng: Any, value: int) -> None:
    if isinstance(rng, torch.Generator):
        rng.manual_seed(value)
    elif isinstance(rng, random.Random):
        rng.seed(value)
    elif np is not None and isinstance(rng, np.random.RandomState):
        rng.seed(value & 0xFFFFFFFF)
    else:  # numpy Generator: a fresh bit generator of the same kind, its state copied in place
        rng.bit_generator.state = type(rng.bit_generator)(value).state


def user_seed(sampler: Any, skip: Sequence[Any] = ()) -> int | None:
    """The seed of the first ``torch.Generator`` the sampler holds (the user's choice), or ``None``."""
    for _, rng in held_rngs(sampler, skip):
        if isinstance(rng, torch.Generator):
            return int(rng.initial_seed())
    return None


def fingerprint(order: Any) -> str:
    """A short digest of an epoch's order: a 1-D index tensor, or a list of batches (their lengths count)."""
    digest = hashlib.sha256()
    if isinstance(order, torch.Tensor):
        digest.update(order.to(torch.int64).contiguous().numpy().tobytes())
    else:
        for batch in order:
            digest.update(len(batch).to_bytes(8, "little"))
            digest.update(torch.as_tensor(list(batch), dtype=torch.int64).numpy().tobytes())
    return digest.hexdigest()[:16]


def drawn_twice(draw: Callable[[], Any], name: str) -> Any:
    """``draw()`` twice; the first result if both are equal, else raise: the order is not reproducible.

    Raises:
        UnsupportedConfigError: the sampler draws another order for the same seed and epoch.
    """
    from ..errors import UnsupportedConfigError

    first, second = draw(), draw()
    if fingerprint(first) != fingerprint(second):
        raise UnsupportedConfigError(
            f"the sampler {name} draws a different order each time for the same epoch, so no position in it can "
            "be resumed: it keeps randomness this package cannot seed (reached: torch.Generator, random.Random "
            "and numpy generators held as attributes, in lists or dicts, and the global RNGs). Keep the sampler's "
            "RNG in such an attribute, or derive its order from set_epoch(epoch)"
        )
    return first
