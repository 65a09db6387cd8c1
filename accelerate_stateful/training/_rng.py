"""Randomness drawn in the data pipeline, reproduced after a resume.

A dataset's ``__getitem__`` that draws from the global RNGs (``torch``,
``random``, ``numpy``) draws from the RNG of the process that fetches it. With
workers, that is the worker's RNG, which restarts from its start-of-epoch seed
in a resumed run, so every augmented sample after a mid-epoch resume would
differ. The rule implemented here: **the global RNGs are seeded from a pure
function of the loader's seed, the epoch and the batch's place in the epoch
(or the sample's index) right before the fetch**, wherever the fetch runs.

Modes (``Accelerator(pipeline_rng=...)``):

- ``"auto"`` (default): per batch where batches are fetched in workers or read
  ahead of the training loop (the dispatcher's reader), as ``"batch"``; where
  the main process fetches each batch right before the loop takes it, nothing
  is added: the draws are part of the process's own RNG stream, which
  ``save_state`` / ``load_state`` restore.
- ``"batch"``: per batch everywhere; in the main process the global RNGs are
  saved before the fetch and restored after it, so the training loop's own
  stream (dropout) never sees the pipeline's draws, and augmented values do
  not depend on the number of workers.
- ``"sample"``: before each ``dataset[i]``, from (seed, epoch, i): augmented
  values do not depend on the world size, the workers or the resume point.
- ``"off"``: torch's behaviour (worker RNGs seeded once per epoch).

``sample_rng(index)`` hands a dataset the per-sample RNG explicitly, in every
mode. See ``docs/exactness.md`` for what each mode costs.
"""

from __future__ import annotations

import contextlib
import functools
import random
from typing import Any, Callable, Iterator, Optional

import torch

from ..position._seeds import mix_seed
from ._rng_prints import numpy_state, random_state, set_numpy_state, set_random_state
from ..errors import LifecycleError, UnsupportedConfigError

try:  # numpy is optional for torch; seed it only where it is installed
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with every supported torch install
    np = None

MODES = ("auto", "batch", "sample", "off")
_BATCH_SALT, _SAMPLE_SALT = 0xBA7C, 0x5A3B

# The batch this process is fetching now: (seed, epoch, rank, origin[, step]; sample_rng reads the first two), or
# None outside a fetch.
_current: Optional[tuple[int, ...]] = None


def check_mode(mode: Any) -> None:
    """Raise ``UnsupportedConfigError`` unless ``mode`` is one of ``MODES``."""
    if mode not in MODES:
        raise UnsupportedConfigError(f"pipeline_rng={mode!r} is not a mode; pass one of {', '.join(map(repr, MODES))}")


# --------------------------------------------------------------------------- global RNGs
def seed_globals(seed: int) -> None:
    """Seed the CPU ``torch``, ``random`` and ``numpy`` global RNGs from one 63-bit seed.

    ``torch.default_generator`` rather than ``torch.manual_seed``: the latter also queues a seed for every
    CUDA device, which costs ~100x more and is not the pipeline's RNG.
    """
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    if np is not None:
        np.random.seed(seed & 0xFFFFFFFF)


def global_states() -> tuple:
    """The CPU ``torch``, ``random`` and ``numpy`` global RNG states (the last take's ``random`` and ``numpy``
    states where those did not change since, ``_rng_prints``: never change one in place)."""
    return torch.get_rng_state(), random_state(), numpy_state()


def set_global_states(saved: tuple) -> None:
    """Put back states taken by :func:`global_states`."""
    torch.set_rng_state(saved[0])
    set_random_state(saved[1])
    if np is not None:
        set_numpy_state(saved[2])


@contextlib.contextmanager
def preserved_globals() -> Iterator[None]:
    """Restore the CPU ``torch``, ``random`` and ``numpy`` global RNG states on exit."""
    saved = global_states()
    try:
        yield
    finally:
        set_global_states(saved)


def batch_seed(key: tuple[int, ...]) -> int:
    """The seed of one batch's fetch, from its key (seed, epoch, rank, origin, step)."""
    return mix_seed(*key, _BATCH_SALT)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one sample: (loader seed, epoch, dataset index), nothing about the topology."""
    return mix_seed(seed, epoch, index, _SAMPLE_SALT)


# --------------------------------------------------------------------------- public per-sample RNG
class SampleRNG:
    """RNGs of one sample, derived from (loader seed, epoch, dataset index) only.

    The same values on any world size, worker count, and after any resume. Use its
    generators (``.torch``, ``.numpy``, ``.random``), or ``with`` it to seed the
    global RNGs for code that draws from them (``torchvision`` transforms), which
    are restored afterwards.

    Examples:
        >>> rng = SampleRNG(sample_seed(1234, 0, 7))
        >>> noise = torch.randn(3, generator=rng.torch)
        >>> with rng:
        ...     same = torch.randn(3)
        >>> torch.equal(noise, same)
        True
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._saved: list[contextlib.ExitStack] = []

    @functools.cached_property
    def torch(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed)

    @functools.cached_property
    def numpy(self) -> Any:
        """A ``numpy.random.RandomState`` seeded as ``with`` seeds numpy's global RNG (same draws)."""
        if np is None:  # pragma: no cover
            raise UnsupportedConfigError("SampleRNG.numpy needs numpy; install it or use .torch / .random")
        return np.random.RandomState(self.seed & 0xFFFFFFFF)

    @functools.cached_property
    def random(self) -> random.Random:
        return random.Random(self.seed)

    def __enter__(self) -> "SampleRNG":
        stack = contextlib.ExitStack()
        stack.enter_context(preserved_globals())
        self._saved.append(stack)
        seed_globals(self.seed)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._saved.pop().close()


def sample_rng(index: int, *, seed: Optional[int] = None, epoch: Optional[int] = None) -> SampleRNG:
    """The RNGs of sample ``index`` in the epoch being read: identical whatever the topology or resume point.

    Call it inside ``__getitem__`` of a map-style dataset read by a prepared stateful loader (in the
    main process or in a worker): the loader's seed and epoch are known there. Elsewhere pass both.

    Args:
        index: The dataset index of the sample (the argument of ``__getitem__``).
        seed: The loader's seed; defaults to that of the loader fetching this sample.
        epoch: The epoch; defaults to that of the loader fetching this sample.

    Raises:
        LifecycleError: Called outside a stateful loader's fetch without ``seed`` and ``epoch``.
    """
    if seed is None or epoch is None:
        if _current is None:
            raise LifecycleError(
                "sample_rng() was called outside a stateful loader's fetch, so the loader's seed and epoch are "
                "unknown; call it inside __getitem__ of a dataset read by a loader from Accelerator.prepare(), "
                "or pass seed=... and epoch=..."
            )
        seed = _current[0] if seed is None else seed
        epoch = _current[1] if epoch is None else epoch
    return SampleRNG(sample_seed(seed, epoch, int(index)))


# --------------------------------------------------------------------------- the fetch hook
class _SampleSeeded(list):
    """A batch's indices that seed the global RNGs from (seed, epoch, index) before each index is fetched."""

    __slots__ = ("key",)

    def __iter__(self) -> Iterator[Any]:
        seed, epoch = self.key[0], self.key[1]
        for index in list.__iter__(self):
            seed_globals(sample_seed(seed, epoch, int(index)))
            yield index


class _Tagged(list):
    """A batch's indices sent to a worker with the key its randomness is drawn from.

    Unpickling it is the first thing a worker does with a batch, right before it
    fetches it, so that is where the key is applied (``_arrive``): it works for
    datasets fetched item by item and for those with ``__getitems__`` alike.
    """

    __slots__ = ("key", "mode")

    def __reduce__(self) -> tuple:
        return _arrive, (self.key, self.mode, list(self))


def _arrive(key: tuple[int, ...], mode: str, indices: list) -> list:
    """In the worker: make ``key`` the current fetch, seed per ``mode``, hand the fetcher its indices."""
    global _current
    _current = key
    if mode in ("auto", "batch"):
        seed_globals(batch_seed(key))
    elif mode == "sample":
        indices = _sample_seeded(key, indices)
    return indices


def _sample_seeded(key: tuple[int, ...], indices: list) -> list:
    batch = _SampleSeeded(indices)
    batch.key = key
    return batch


class PipelineRNG:
    """How one loader reproduces its pipeline's randomness (see the module docstring).

    Args:
        mode: One of ``MODES``.
        num_workers: The loader's workers; 0 fetches in the main process.
        dataset: The dataset, checked for what ``mode`` needs.
    """

    def __init__(self, mode: str, num_workers: int, dataset: Any, whole_batches: bool = False) -> None:
        check_mode(mode)
        if mode == "sample" and (whole_batches or getattr(dataset, "__getitems__", None)):
            how = "is given whole batches by its sampler" if whole_batches else "fetches whole batches with __getitems__"
            raise UnsupportedConfigError(
                f"pipeline_rng='sample' seeds the RNGs before each dataset[i], but {type(dataset).__name__} "
                f"{how}; use pipeline_rng='batch', or sample_rng(index) inside the dataset"
            )
        self.mode = mode
        self.in_workers = num_workers > 0

    def tag(self, where: tuple[int, ...], step: int, indices: list) -> list:
        """What the batch sampler yields for batch ``step`` of the pass at ``where``: the indices, tagged if needed."""
        if self.in_workers:
            batch = _Tagged(indices)
            batch.key, batch.mode = (*where, step), self.mode
            return batch
        return _sample_seeded((*where, step), indices) if self.mode == "sample" else indices

    def tagger(self, where: tuple[int, ...]) -> Optional[Callable[[int, list], list]]:
        """:meth:`tag` for the pass at ``where``; ``None`` where it would hand the indices back as they are (fetched
        in the main process, ``mode`` other than ``"sample"``), so that nothing is called per batch."""
        if not self.in_workers and self.mode != "sample":
            return None
        return functools.partial(self.tag, where)

    def fetch(self, batches: Iterator[Any], where: tuple[int, ...], step: int, read_ahead: bool) -> Iterator[Any]:
        """Yield from the base loader's iterator, each fetch in the main process inside its batch's scope.

        ``read_ahead``: the caller may fetch batches before the training loop takes them (a dispatcher's
        reader), so the process's RNG stream at a save would not be where those fetches drew from.
        """
        if self.in_workers:
            yield from batches
            return
        global _current
        seeded = self.mode == "batch" or (self.mode == "auto" and read_ahead)
        scoped = seeded or self.mode == "sample"
        while True:
            # With nothing drawn for the fetch, only sample_rng reads the key: the pass's seed and epoch
            key = (*where, step) if scoped else where
            saved = global_states() if scoped else None  # preserved_globals(), without a context per batch
            _current = key
            if seeded:
                seed_globals(batch_seed(key))
            try:
                batch = next(batches)
            except StopIteration:
                return
            finally:
                _current = None
                if saved is not None:
                    set_global_states(saved)
            yield batch
            step += 1
