"""Where data comes from when it is not a plain dataset: logical shards, round-robin and composable sources.

The public names are imported on first use (PEP 562), as in the package's front door: the command line
imports modules of this package and must not import torch with them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Each public name (``__all__``), and the module that defines it.
_SOURCES = {
    "Mixture": ".mixture",
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
    from .mixture import Mixture
