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


def test_importing_the_package_imports_no_public_name_until_it_is_used():
    """The command line imports the package; only the names it uses may be imported (and torch with them)."""
    import subprocess
    import sys

    code = ("import sys, accelerate_stateful as a; print('torch' in sys.modules); "
            "from accelerate_stateful import ShardDataLoader, __version__; print('torch' in sys.modules); "
            "print(sorted(set(a.__all__) - set(dir(a))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split("\n")[:3] == ["False", "True", "[]"], done.stderr
