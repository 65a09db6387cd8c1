"""Where data comes from when it is not a plain dataset: logical shards, round-robin sources, and the
composable sources of language-model pipelines (mixtures, packing, shuffle buffers), and object-store
streaming datasets read by index (``Indexed``).

The public names are imported on first use (PEP 562), as in the package's front door: the command line
imports modules of this package (``sources._merge``) and must not import torch or numpy with them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Each public name (``__all__``), and the module that defines it.
_SOURCES = {
    "Filtered": ".filtered",
    "Indexed": ".indexed",
    "Mixture": ".mixture",
    "Packed": ".packed",
    "Ramp": ".schedule",
    "Shuffled": ".shuffle",
    "Stages": ".schedule",
    "exact_shuffle": ".shuffle",
}

__all__ = sorted(_SOURCES)


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(source, __name__), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from .filtered import Filtered
    from .indexed import Indexed
    from .mixture import Mixture
    from .packed import Packed
    from .schedule import Ramp, Stages
    from .shuffle import Shuffled, exact_shuffle
