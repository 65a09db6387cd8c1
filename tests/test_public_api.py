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


def test_all_is_exactly_the_intended_public_surface_and_sorted():
    assert accelerate_stateful.__all__ == INTENDED
    assert sorted(accelerate_stateful.__all__) == accelerate_stateful.__all__
    for name in INTENDED:
        assert hasattr(accelerate_stateful, name)
    assert sorted(accelerate_stateful._SOURCES) == INTENDED  # every public name is imported on first use


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


def test_type_checkers_and_the_api_reference_see_every_public_name_imported():
    """The lazy front door also imports every name under ``if TYPE_CHECKING:`` (what type checkers and the
    mkdocstrings API reference read), from the module ``__getattr__`` imports it from."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(accelerate_stateful.__file__).read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING")
    seen = {alias.name: "." * node.level + node.module for node in block.body for alias in node.names}
    assert seen == accelerate_stateful._SOURCES
