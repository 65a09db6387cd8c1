"""Accelerate's own tests, run with this package's ``Accelerator`` (``nox -s conformance``).

The tests are those of the installed Accelerate release (``setup.py`` pins it for the tests), taken at run
time from its source distribution on PyPI (``pip download accelerate==<version> --no-binary :all:``; pip's
cache keeps it), never copied into this repository. ``tools/accelerate_conformance/conftest.py``, put beside
them, makes ``accelerate.Accelerator`` this package's. The run fails when a selected test fails or skips.

Usage: ``python tools/accelerate_conformance.py [--workdir DIR] [pytest options]``
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import accelerate
import pytest

HERE = Path(__file__).resolve().parent
# Checkpointing, the Accelerator, and the data-loop tests of test_data_loader.py that prepare through an Accelerator.
SELECTION = (
    "test_accelerator.py",
    "test_state_checkpointing.py",
    "test_data_loader.py::DataLoaderTester::test_iterable_dataset_with_non_tensor_samples",
    "test_data_loader.py::DataLoaderTester::test_set_epoch_in_batch_sampler",
    "test_data_loader.py::DataLoaderTester::test_ensure_dataloader_gets_cleaned_up",
)
_GPU = "needs a GPU (CI has none)"
_BNB = "needs bitsandbytes and a GPU"
# Every selected test that is not run, with the reason; nothing else may be left out or skipped.
DESELECTED = {
    "test_accelerator.py::AcceleratorTester::test_accelerator_bnb": _BNB,
    "test_accelerator.py::AcceleratorTester::test_accelerator_bnb_cpu_error": _BNB,
    "test_accelerator.py::AcceleratorTester::test_accelerator_bnb_multi_device": _BNB + "s",
    "test_accelerator.py::AcceleratorTester::test_accelerator_bnb_multi_device_no_distributed": _BNB + "s",
    "test_accelerator.py::AcceleratorTester::test_accelerator_can_be_reinstantiated": _GPU,
    "test_accelerator.py::AcceleratorTester::test_accelerator_cpu_flag_prepare": _GPU,
    "test_accelerator.py::AcceleratorTester::test_can_unwrap_model_fp16": _GPU,
    "test_accelerator.py::AcceleratorTester::test_can_unwrap_model_te": "needs Transformer Engine and FP8 hardware",
    "test_accelerator.py::AcceleratorTester::test_get_state_dict_from_offload_use_pytorch": _GPU,
    "test_accelerator.py::AcceleratorTester::test_get_state_dict_from_offload_use_safetensors": _GPU,
    "test_accelerator.py::AcceleratorTester::test_nested_hook": _GPU,
    "test_accelerator.py::AcceleratorTester::test_setting_cpu_affinity": "needs a CUDA GPU",
    "test_state_checkpointing.py::CheckpointTest_use_safetensors::test_map_location": _GPU,
    "test_state_checkpointing.py::CheckpointTest_use_pytorch::test_map_location": _GPU,
    "test_data_loader.py::DataLoaderTester::test_set_epoch_in_batch_sampler": (
        "asserts that loader.set_epoch(1) calls the batch sampler's set_epoch at once; ours calls it when the "
        "epoch's order is drawn, at the start of the pass (loaders/batchsampler.py draw_batches), since the order "
        "is a pure function of (seed, epoch)"),
    "test_data_loader.py::DataLoaderTester::test_ensure_dataloader_gets_cleaned_up": (
        "reads loader.gradient_state, an attribute of Accelerate's own loader classes; ours reach Accelerate's "
        "GradientState without keeping it (composition). That the loader is freed: tests/test_free_memory.py"),
}


class NoSkips:
    """Fail the run when a selected test skips: a skip here is a test silently not run."""

    def __init__(self) -> None:
        self.skipped: list[str] = []

    def pytest_runtest_logreport(self, report) -> None:
        if report.skipped:
            self.skipped.append(report.nodeid)


def fetch_tests(version: str, workdir: Path) -> Path:
    """Accelerate ``version``'s ``tests/`` folder from its source distribution, with our conftest beside it."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", f"accelerate=={version}", "--no-binary", ":all:",
         "--no-deps", "-d", str(workdir)],
        check=True,
    )
    with tarfile.open(workdir / f"accelerate-{version}.tar.gz") as archive:
        members = [m for m in archive.getmembers() if m.name.startswith(f"accelerate-{version}/tests/")]
        if not members:
            raise SystemExit(f"accelerate {version}'s source distribution carries no tests/ folder")
        archive.extractall(workdir, members=members, filter="data")
    tests = workdir / f"accelerate-{version}" / "tests"
    shutil.copy(HERE / "accelerate_conformance" / "conftest.py", tests / "conftest.py")
    return tests


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, help="where to unpack the tests (default: a temporary folder)")
    args, pytest_args = parser.parse_known_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        tests = fetch_tests(accelerate.__version__, workdir)
        print(f"accelerate {accelerate.__version__}'s tests, with accelerate_stateful.Accelerator; deselected:")
        for nodeid, reason in DESELECTED.items():
            print(f"  {nodeid}: {reason}")
        deselect = [arg for nodeid in DESELECTED for arg in ("--deselect", nodeid)]
        no_skips = NoSkips()
        code = pytest.main(
            ["-q", "-p", "no:cacheprovider", "--rootdir", str(tests), *deselect, *pytest_args,
             *(str(tests / s) for s in SELECTION)],
            plugins=[no_skips],
        )
    if no_skips.skipped:
        print(f"selected tests skipped (list them in DESELECTED with the reason): {no_skips.skipped}")
        return 1
    return int(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
