"""The ``random`` and ``numpy`` global RNG states, taken again only when they changed.

A stream records the global RNG states after every batch (``loaders/_stream_rng``) and swaps its own in
around every read in the main process. ``random.getstate()`` builds a tuple of 625 ints (15 µs here) and
``numpy.random.get_state()`` copies its key into a new array (30 µs), while most streams never draw from
either. So each take first reads the generator's raw state bytes (under 1 µs): **where they are the bytes
of the last take, the last take's state object is returned** (states are never changed in place, so
sharing one is safe).

The bytes read are the generator's whole state, so equal bytes are equal states:

- ``numpy``: the ``MT19937`` bit generator's state struct (key and position), through its public
  ``ctypes.state_address``. The legacy generator also caches one Gaussian outside it, which a draw can
  use up without moving the key: the bytes stand for the state only while that cache is empty (the last
  state taken says so); otherwise it is taken in full.
- ``random``: CPython's ``Random`` object holds its index and key right after the object header; they are
  read from there only once a probe at import found them where ``getstate()`` reports them (otherwise, and
  on other interpreters or free-threaded builds, every take calls ``getstate()``). The Gaussian it caches
  (``gauss_next``) is a plain attribute, compared too.

The bytes are read before the state: a draw between the two reads leaves bytes that no longer match the
next time, and the state is taken again.
"""

from __future__ import annotations

import ctypes
import random
import sys
import sysconfig
from typing import Any, Callable, Optional

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with every supported torch install
    np = None

_MT_WORDS = 624


def _random_reader() -> Optional[Callable[[random.Random], bytes]]:
    """A reader of a ``random.Random``'s raw state (index, then key), where a probe finds it in memory."""
    if sys.implementation.name != "cpython" or sysconfig.get_config_var("Py_GIL_DISABLED"):
        return None
    offset, size = object.__basicsize__, 4 + 4 * _MT_WORDS  # after PyObject_HEAD: int index; uint32_t state[624]
    base = random.Random.__mro__[1]  # the C type (``_random.Random``)
    if base.__basicsize__ < offset + size:
        return None

    def read(rng: random.Random) -> bytes:
        return ctypes.string_at(id(rng) + offset, size)

    for seed in (0, 20261129):
        probe = random.Random(seed)
        for draws in (0, 1, 700):
            for _ in range(draws):
                probe.random()
            raw = read(probe)
            words = [int.from_bytes(raw[4 + 4 * k: 8 + 4 * k], sys.byteorder) for k in range(_MT_WORDS)]
            index = int.from_bytes(raw[:4], sys.byteorder, signed=True)
            if tuple(words) + (index,) != probe.getstate()[1]:
                return None
    return read


def _numpy_layout() -> bool:
    """Whether an ``MT19937``'s state struct holds its key, then its position, as ``get_state()`` reports them."""
    if np is None:
        return False
    for seed in (0, 20261129):
        probe = np.random.RandomState(seed)
        for draws in (0, 1, 700):
            probe.random_sample(draws)
            raw = _numpy_bytes(probe._bit_generator)
            _, key, pos, _, _ = probe.get_state()
            if raw != _state_bytes(key, pos):
                return False
    return True


def _numpy_bytes(bits: Any) -> bytes:
    return ctypes.string_at(bits.ctypes.state_address, 4 * _MT_WORDS + 4)


def _state_bytes(key: Any, pos: int) -> bytes:
    """The struct bytes of a legacy state's key (624 uint32) and position."""
    return key.astype(np.uint32, copy=False).tobytes() + int(pos).to_bytes(4, sys.byteorder, signed=True)


_read_random = _random_reader()
_NUMPY_LAYOUT = _numpy_layout()
_taken_random: tuple[Any, Any] = (None, None)  # ((generator, bytes, Gaussian) at the last take, the state then)
_taken_numpy: tuple[Any, Any] = (None, None)


def random_state() -> tuple:
    """``random.getstate()``, or the last one taken if the generator has not changed since."""
    global _taken_random
    rng = getattr(random.getstate, "__self__", None)  # the generator ``random.getstate()`` reads
    if _read_random is None or type(rng) is not random.Random:
        return random.getstate()
    found = (rng, _read_random(rng), rng.gauss_next)
    last, state = _taken_random
    if last is not None and found[0] is last[0] and found[1:] == last[1:]:
        return state
    state = random.getstate()
    _taken_random = (found, state)
    return state


def numpy_state() -> Optional[tuple]:
    """``numpy.random.get_state()``, or the last one taken if the generator has not changed since."""
    global _taken_numpy
    if np is None:
        return None
    found = _numpy_now()
    if found is None:
        return np.random.get_state()
    last, state = _taken_numpy
    # state[3]: has_gauss, a cached Gaussian the bytes do not show
    if last is not None and found[0] is last[0] and found[1] == last[1] and not state[3]:
        return state
    state = np.random.get_state()
    _taken_numpy = (found, state)
    return state


def _numpy_now() -> Optional[tuple]:
    """(the generator ``np.random.get_state()`` reads, its state bytes), or None where they cannot be read."""
    generator = getattr(np.random.get_state, "__self__", None)
    bits = getattr(generator, "_bit_generator", None)
    if not _NUMPY_LAYOUT or type(bits) is not np.random.MT19937:
        return None
    return generator, _numpy_bytes(bits)


def set_random_state(state: tuple) -> None:
    """``random.setstate(state)``, skipped where it is the state now; the next take returns ``state``."""
    global _taken_random
    if random_state() is state:
        return
    random.setstate(state)
    rng = getattr(random.getstate, "__self__", None)
    if _read_random is not None and type(rng) is random.Random:
        _taken_random = ((rng, _read_random(rng), rng.gauss_next), state)


def set_numpy_state(state: tuple) -> None:
    """``np.random.set_state(state)``, skipped where it is the state now, and written as the bit generator's
    bytes where neither the state now nor ``state`` caches a Gaussian (``set_state`` costs 35 µs: it checks
    and converts its argument). The next take returns ``state``."""
    global _taken_numpy
    now = numpy_state()
    if now is state:
        return
    found = _numpy_now()
    if (found is not None and not now[3] and not state[3] and state[0] == "MT19937"
            and getattr(state[1], "shape", None) == (_MT_WORDS,) and 0 <= int(state[2]) <= _MT_WORDS):
        target = _state_bytes(state[1], state[2])
        ctypes.memmove(found[0]._bit_generator.ctypes.state_address, target, len(target))
        _taken_numpy = ((found[0], target), state)
        return
    np.random.set_state(state)
    found = _numpy_now()
    if found is not None:
        _taken_numpy = (found, state)
