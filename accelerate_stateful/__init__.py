"""accelerate-stateful: exact, replay-free mid-epoch resume for Hugging Face Accelerate loaders.

The public names are imported on first use (PEP 562), so that ``import accelerate_stateful`` and the command
line (``python -m accelerate_stateful inspect``), which reads JSON files only, do not import torch.
``from accelerate_stateful import X`` and ``accelerate_stateful.X`` work as with eager imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Each public name (``__all__``, below), and the module that defines it.
_SOURCES = {
    "Accelerator": ".accelerator",
    "BatchSamplerDataLoader": ".loaders.batchsampler",
    "CheckpointError": ".errors",
    "DataLoaderAdapter": ".loaders._adapter",
    "DispatchDataLoader": ".loaders.dispatch",
    "DistContext": "._context",
    "FORMAT_VERSION": ".checkpoint._state",
    "Filtered": ".sources.filtered",
    "HFShards": ".sources.sharded",
    "Indexed": ".sources.indexed",
    "IterableShardDataLoader": ".loaders.iterable",
    "LifecycleError": ".errors",
    "LoaderCheckpoint": ".checkpoint.dcp",
    "LoaderState": ".checkpoint._state",
    "LogicalShardStream": ".sources.sharded",
    "Mismatch": ".errors",
    "Mixture": ".sources.mixture",
    "PREEMPTED_EXIT_CODE": ".training._preemption",
    "Packed": ".sources.packed",
    "Phase": ".loaders._passes",
    "Ramp": ".sources.schedule",
    "RoundRobinDataset": ".sources.roundrobin",
    "RoundRobinLoader": ".sources.roundrobin",
    "SampleRNG": ".training._rng",
    "Shuffled": ".sources.shuffle",
    "ShardDataLoader": ".loaders.shard",
    "ShardPlan": ".position._plan",
    "ShardedSource": ".sources.sharded",
    "SkipDataLoader": ".loaders.skip",
    "Stages": ".sources.schedule",
    "StateMismatchError": ".errors",
    "StateSerializationError": ".errors",
    "StatefulLoaderError": ".errors",
    "TextLines": ".sources.sharded",
    "UnsupportedConfigError": ".errors",
    "exact_shuffle": ".sources.shuffle",
    "latest_checkpoint": ".checkpoint._files",
    "sample_rng": ".training._rng",
}

__all__ = [
    "Accelerator",
    "BatchSamplerDataLoader",
    "CheckpointError",
    "DataLoaderAdapter",
    "DispatchDataLoader",
    "DistContext",
    "FORMAT_VERSION",
    "Filtered",
    "HFShards",
    "Indexed",
    "IterableShardDataLoader",
    "LifecycleError",
    "LoaderCheckpoint",
    "LoaderState",
    "LogicalShardStream",
    "Mismatch",
    "Mixture",
    "PREEMPTED_EXIT_CODE",
    "Packed",
    "Phase",
    "Ramp",
    "RoundRobinDataset",
    "RoundRobinLoader",
    "SampleRNG",
    "ShardDataLoader",
    "ShardPlan",
    "ShardedSource",
    "Shuffled",
    "SkipDataLoader",
    "Stages",
    "StateMismatchError",
    "StateSerializationError",
    "StatefulLoaderError",
    "TextLines",
    "UnsupportedConfigError",
    "exact_shuffle",
    "latest_checkpoint",
    "sample_rng",
]


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(source, __name__), name)
    globals()[name] = value  # imported once; later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers and IDEs see: the eager imports
    from ._context import DistContext
    from .accelerator import Accelerator
    from .checkpoint._files import latest_checkpoint
    from .checkpoint._state import FORMAT_VERSION, LoaderState
    from .checkpoint.dcp import LoaderCheckpoint
    from .errors import (
        CheckpointError,
        LifecycleError,
        Mismatch,
        StateMismatchError,
        StateSerializationError,
        StatefulLoaderError,
        UnsupportedConfigError,
    )
    from .loaders._adapter import DataLoaderAdapter
    from .loaders._passes import Phase
    from .loaders.batchsampler import BatchSamplerDataLoader
    from .loaders.dispatch import DispatchDataLoader
    from .loaders.iterable import IterableShardDataLoader
    from .loaders.shard import ShardDataLoader
    from .loaders.skip import SkipDataLoader
    from .position._plan import ShardPlan
    from .sources.filtered import Filtered
    from .sources.indexed import Indexed
    from .sources.mixture import Mixture
    from .sources.packed import Packed
    from .sources.roundrobin import RoundRobinDataset, RoundRobinLoader
    from .sources.schedule import Ramp, Stages
    from .sources.sharded import HFShards, LogicalShardStream, ShardedSource, TextLines
    from .sources.shuffle import Shuffled, exact_shuffle
    from .training._preemption import PREEMPTED_EXIT_CODE
    from .training._rng import SampleRNG, sample_rng
