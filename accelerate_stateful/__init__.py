"""accelerate-stateful: exact, replay-free mid-epoch resume for Hugging Face Accelerate loaders."""

from ._adapter import DataLoaderAdapter, Phase
from ._context import DistContext
from ._files import latest_checkpoint
from ._position import ShardPlan
from ._preemption import PREEMPTED_EXIT_CODE
from ._rng import SampleRNG, sample_rng
from ._state import FORMAT_VERSION, LoaderState
from .accelerator import Accelerator
from .batchsampler import BatchSamplerDataLoader
from .errors import (
    CheckpointError,
    LifecycleError,
    Mismatch,
    StateMismatchError,
    StateSerializationError,
    StatefulLoaderError,
    UnsupportedConfigError,
)
from .dcp import LoaderCheckpoint
from .dispatch import DispatchDataLoader
from .iterable import IterableShardDataLoader
from .roundrobin import RoundRobinDataset, RoundRobinLoader
from .shard import ShardDataLoader
from .sharded import HFShards, LogicalShardStream, ShardedSource, TextLines
from .skip import SkipDataLoader

__version__ = "0.1.0"

__all__ = [
    "Accelerator",
    "BatchSamplerDataLoader",
    "CheckpointError",
    "DataLoaderAdapter",
    "DispatchDataLoader",
    "DistContext",
    "FORMAT_VERSION",
    "HFShards",
    "IterableShardDataLoader",
    "LifecycleError",
    "LoaderCheckpoint",
    "LoaderState",
    "LogicalShardStream",
    "Mismatch",
    "PREEMPTED_EXIT_CODE",
    "Phase",
    "RoundRobinDataset",
    "RoundRobinLoader",
    "SampleRNG",
    "ShardDataLoader",
    "ShardPlan",
    "ShardedSource",
    "SkipDataLoader",
    "StateMismatchError",
    "StateSerializationError",
    "StatefulLoaderError",
    "TextLines",
    "UnsupportedConfigError",
    "latest_checkpoint",
    "sample_rng",
]
