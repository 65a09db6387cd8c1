"""The global RNGs a stream draws from while it is read: its own, seeded per pass, recorded after each batch.

An iterable dataset that augments (``torch.rand``, ``random``, ``numpy.random`` in ``__iter__``) draws from the
global RNGs of the process that reads it. The rule: **a stream draws from RNG states of its own — seeded at
the start of each pass from (the pass's base seed, the epoch, the logical worker) — and the state of a stream
after a batch includes those RNG states**, so a resume puts them back with the dataset's position.

- In a worker, the worker's process RNGs are the stream's (``_stream._play_worker`` seeds them per pass).
- In the main process (``num_workers=0``, the dispatcher's reader), the process's RNGs are also the training
  loop's (dropout) and are saved by Accelerate at the loop's point, while the loader reads one batch ahead:
  the stream would draw its next batch from the loop's stream before the save, and again after the resume.
  Here :class:`OwnRNG` holds the stream's states and swaps them in around every read, so neither stream sees
  the other's draws and the read-ahead does not matter.
- :func:`record` is taken right after each batch's last item, where the batch's snapshot is taken; on resume
  :func:`apply` restores it once the dataset is positioned (after a fast-forward, which draws again what the
  saved run drew, so the two agree).
"""

from __future__ import annotations

import contextlib
import random
from typing import Any, Iterator

import torch

from ..sources._recorded import Deferred
from ..training._rng import global_states, preserved_globals, seed_globals, set_global_states

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy is a dependency of torch's usual installs
    np = None


class OwnRNG:
    """The ``torch``, ``random`` and ``numpy`` global RNG states of one stream, kept apart from the process's."""

    def __init__(self, seed: int) -> None:
        with preserved_globals():
            seed_globals(seed)
            self.states = global_states()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Run with the stream's states (kept afterwards); the process's own are restored on exit."""
        outer = global_states()
        set_global_states(self.states)
        try:
            yield
        finally:
            self.states = global_states()
            set_global_states(outer)


def own_rng(items: Iterator[Any], seed: int) -> Iterator[Any]:
    """``items``, each read with the stream's own RNG states (see the module docstring)."""
    rng = OwnRNG(seed)
    while True:
        with rng.active():
            item = next(items, None)
        if item is None:
            return
        yield item


def record() -> dict:
    """The global RNG states now, in types a checkpoint holds (tensors, lists, numbers)."""
    return _checkpoint_types(global_states())


class Taken(Deferred):
    """The global RNG states as they are now, put in a checkpoint's types (:func:`record`'s) only when they are
    read: pickled (a worker's snapshot, sent to the main process when a checkpoint asks for it, converted there)
    or :meth:`settled` (``sources/_recorded``). A stream takes them after every batch; most are never read."""

    __slots__ = ("states",)

    def __init__(self) -> None:
        self.states = global_states()

    def settled(self) -> dict:
        return _checkpoint_types(self.states)

    def __reduce__(self) -> tuple:
        return _checkpoint_types, (self.states,)


def _checkpoint_types(states: tuple) -> dict:
    torch_state, random_state, numpy_state = states
    found = {"torch": torch_state, "random": [random_state[0], list(random_state[1]), random_state[2]]}
    if numpy_state is not None:
        name, keys, pos, has_gauss, gauss = numpy_state
        found["numpy"] = [name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss)]
    return found


def apply(saved: dict) -> None:
    """Set the global RNGs to a :func:`record`."""
    torch.set_rng_state(saved["torch"])
    version, internal, gauss = saved["random"]
    random.setstate((version, tuple(internal), gauss))
    if np is not None and "numpy" in saved:
        name, keys, pos, has_gauss, gauss = saved["numpy"]
        keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
        np.random.set_state((name, keys.astype(np.uint32), pos, has_gauss, gauss))
