"""accelerate-stateful: exact, replay-free mid-epoch resume for Hugging Face Accelerate loaders."""

from .loaders._adapter import DataLoaderAdapter, Phase
from ._context import DistContext
from .checkpoint._files import latest_checkpoint
from .position._plan import ShardPlan
from .training._preemption import PREEMPTED_EXIT_CODE
from .training._rng import SampleRNG, sample_rng
from .checkpoint._state import FORMAT_VERSION, LoaderState
from .accelerator import Accelerator
from .loaders.batchsampler import BatchSamplerDataLoader
from .errors import (
    CheckpointError,
    LifecycleError,
    Mismatch,
    StateMismatchError,
    StateSerializationError,
    StatefulLoaderError,
    UnsupportedConfigError,
)
from .checkpoint.dcp import LoaderCheckpoint
from .loaders.dispatch import DispatchDataLoader
from .loaders.iterable import IterableShardDataLoader
from .sources.roundrobin import RoundRobinDataset, RoundRobinLoader
from .loaders.shard import ShardDataLoader
from .sources.sharded import HFShards, LogicalShardStream, ShardedSource, TextLines
from .loaders.skip import SkipDataLoader

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
