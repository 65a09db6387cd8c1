"""Where data comes from when it is not a plain dataset: logical shards, round-robin sources, packing, shuffle buffers."""

# The public sources, imported on first use (PEP 562): the command line imports ``sources._merge``, which
# runs this file, and must not import torch or numpy.
import importlib as _importlib
from typing import Any as _Any

_SOURCES = {
    "Packed": ".packed",
    "Shuffled": ".shuffle",
    "exact_shuffle": ".shuffle",
}


def __getattr__(name: str) -> _Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(source, __name__), name)
    globals()[name] = value
    return value
