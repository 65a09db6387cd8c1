"""The public surface is exactly the intended one."""

import accelerate_stateful

INTENDED = [
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


def test_all_is_exactly_the_intended_public_surface_and_sorted():
    assert accelerate_stateful.__all__ == INTENDED
    assert sorted(accelerate_stateful.__all__) == accelerate_stateful.__all__
    for name in INTENDED:
        assert hasattr(accelerate_stateful, name)


def test_every_error_derives_from_the_package_base():
    for name in INTENDED:
        obj = getattr(accelerate_stateful, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, accelerate_stateful.StatefulLoaderError)
