"""The ``random`` and ``numpy`` global RNG states, taken and set again only when they changed.

A stream records the global RNG states after every batch (``loaders/_stream_rng``) and, in the main process,
swaps its own in around every read. ``random.getstate()`` builds a tuple of 625 ints (15 µs here),
``numpy.random.get_state()`` copies its key into a new array (30 µs) and ``numpy.random.set_state()`` checks
and converts its argument (35 µs), while most streams never draw from either. So each take first reads the
generator's raw state bytes (0.2 µs): **where they are the bytes of the last take or set, that state object
is returned** (states are never changed in place, so sharing one is safe).

The bytes read are the generator's whole state, so equal bytes are equal states:

- ``numpy``: the ``MT19937`` bit generator's state struct (key and position), through its public
  ``ctypes.state_address``. The legacy generator also caches one Gaussian outside it, which a draw can
  use up without moving the key: the bytes stand for the state only while that cache is empty (the last
  state taken says so); otherwise it is taken in full. A set where neither state caches one writes the
  bytes, under the generator's lock.
- ``random``: CPython's ``Random`` object holds its index and key right after the object header; they are
  read from there only once a probe at import found them where ``getstate()`` reports them (otherwise, and
  on other interpreters or free-threaded builds, every take calls ``getstate()``). The Gaussian it caches
  (``gauss_next``) is a plain attribute, compared too.

The bytes are read before the state: a draw between the two reads leaves bytes that no longer match the
next time, and the state is taken again.
"""

from __future__ import annotations

import array
import ctypes
import random
import sys
import sysconfig
from typing import Any, Optional

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with every supported torch install
    np = None

_MT_WORDS = 624
_RANDOM_OFFSET, _RANDOM_SIZE = object.__basicsize__, 4 + 4 * _MT_WORDS  # after PyObject_HEAD: index, key
_NUMPY_SIZE = 4 * _MT_WORDS + 4  # key, then position


class _Raw:
    """The raw state bytes of one generator object, read (and written) through a view made once."""

    __slots__ = ("owner", "_view")

    def __init__(self, owner: Any, address: int, size: int) -> None:
        self.owner = owner  # held: the view's memory is the owner's
        self._view = (ctypes.c_char * size).from_address(address)

    def read(self) -> bytes:
        return self._view.raw

    def write(self, data: bytes) -> None:
        self._view.raw = data


def _random_raw(rng: random.Random) -> _Raw:
    return _Raw(rng, id(rng) + _RANDOM_OFFSET, _RANDOM_SIZE)


def _numpy_raw(generator: Any) -> _Raw:
    return _Raw(generator, generator._bit_generator.ctypes.state_address, _NUMPY_SIZE)


def _random_readable() -> bool:
    """Whether a ``random.Random``'s index and key lie right after its header, as ``getstate()`` reports them."""
    if sys.implementation.name != "cpython" or sysconfig.get_config_var("Py_GIL_DISABLED"):
        return False
    if random.Random.__mro__[1].__basicsize__ < _RANDOM_OFFSET + _RANDOM_SIZE:  # the C type, ``_random.Random``
        return False
    if array.array("I").itemsize != 4:
        return False
    for seed in (0, 20261129):
        probe = random.Random(seed)
        for draws in (0, 1, 700):
            for _ in range(draws):
                probe.random()
            raw = _random_raw(probe).read()
            index = int.from_bytes(raw[:4], sys.byteorder, signed=True)
            if tuple(array.array("I", raw[4:])) + (index,) != probe.getstate()[1]:
                return False
    return True


def _numpy_readable() -> bool:
    """Whether an ``MT19937``'s state struct holds its key, then its position, as ``get_state()`` reports them."""
    if np is None:
        return False
    for seed in (0, 20261129):
        probe = np.random.RandomState(seed)
        for draws in (0, 1, 700):
            probe.random_sample(draws)
            _, key, pos, _, _ = probe.get_state()
            if _numpy_raw(probe).read() != _state_bytes(key, pos):
                return False
    return True


def _state_bytes(key: Any, pos: int) -> bytes:
    """The struct bytes of a legacy state's key (624 uint32) and position."""
    return key.astype(np.uint32, copy=False).tobytes() + int(pos).to_bytes(4, sys.byteorder, signed=True)


_RANDOM_READABLE = _random_readable()
_NUMPY_READABLE = _numpy_readable()
# Per generator: its raw view, then (the bytes and, for ``random``, the cached Gaussian) at the last take or
# set, and the state then.
_random_last: tuple[Optional[_Raw], Any, Any] = (None, None, None)
_numpy_last: tuple[Optional[_Raw], Any, Any] = (None, None, None)


def _random_now() -> Optional[tuple[_Raw, tuple]]:
    """(the raw view of the generator ``random.getstate()`` reads, its (bytes, Gaussian) now), where readable."""
    global _random_last
    rng = getattr(random.getstate, "__self__", None)
    if not _RANDOM_READABLE or type(rng) is not random.Random:
        return None
    raw = _random_last[0]
    if raw is None or raw.owner is not rng:
        raw = _random_raw(rng)
        _random_last = (raw, None, None)
    return raw, (raw.read(), rng.gauss_next)


def _numpy_now() -> Optional[tuple[_Raw, bytes]]:
    """(the raw view of the generator ``np.random.get_state()`` reads, its bytes now), where readable."""
    global _numpy_last
    generator = getattr(np.random.get_state, "__self__", None)
    if not _NUMPY_READABLE or type(getattr(generator, "_bit_generator", None)) is not np.random.MT19937:
        return None
    raw = _numpy_last[0]
    if raw is None or raw.owner is not generator:
        raw = _numpy_raw(generator)
        _numpy_last = (raw, None, None)
    return raw, raw.read()


def random_state() -> tuple:
    """``random.getstate()``, or the last state taken or set if the generator has not changed since."""
    global _random_last
    found = _random_now()
    if found is None:
        return random.getstate()
    raw, now = found
    if now == _random_last[1]:
        return _random_last[2]
    state = random.getstate()
    _random_last = (raw, now, state)
    return state


def numpy_state() -> Optional[tuple]:
    """``numpy.random.get_state()``, or the last state taken or set if the generator has not changed since."""
    global _numpy_last
    if np is None:
        return None
    found = _numpy_now()
    if found is None:
        return np.random.get_state()
    raw, now = found
    last = _numpy_last[2]
    if now == _numpy_last[1] and not last[3]:  # last[3]: has_gauss, a cached Gaussian the bytes do not show
        return last
    state = np.random.get_state()
    _numpy_last = (raw, now, state)
    return state


def set_random_state(state: tuple) -> None:
    """``random.setstate(state)``, skipped where it is the state now; the next take returns ``state``."""
    global _random_last
    if random_state() is state:
        return
    random.setstate(state)
    found = _random_now()
    if found is not None:
        _random_last = (found[0], found[1], state)


def set_numpy_state(state: tuple) -> None:
    """``np.random.set_state(state)``, skipped where it is the state now, and written as the bit generator's
    bytes where neither the state now nor ``state`` caches a Gaussian. The next take returns ``state``."""
    global _numpy_last
    now = numpy_state()
    if now is state:
        return
    raw = _numpy_last[0] if _NUMPY_READABLE and now is _numpy_last[2] else None  # ``now`` was read through it
    if (raw is not None and not now[3] and not state[3] and state[0] == "MT19937"
            and getattr(state[1], "shape", None) == (_MT_WORDS,) and 0 <= int(state[2]) <= _MT_WORDS):
        data = _state_bytes(state[1], state[2])
        with raw.owner._bit_generator.lock:  # the lock numpy's own draws and set_state take
            raw.write(data)
        _numpy_last = (raw, data, state)
        return
    np.random.set_state(state)
    found = _numpy_now()
    if found is not None:
        _numpy_last = (found[0], found[1], state)
