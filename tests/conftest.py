"""Shared test set-up: the ``multiprocess`` marker, every test isolated from distributed state, and a fresh
Accelerate state for tests that build ``Accelerator`` objects."""

from __future__ import annotations

import gc
import os

import pytest
import torch.distributed as dist
from accelerate.state import AcceleratorState, GradientState

# Variables a launcher (torchrun, accelerate launch) sets; a test inheriting them would think it is one rank of many.
DISTRIBUTED_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "multiprocess: launches real processes with `accelerate launch` (deselect with -m 'not multiprocess')"
    )


# Launch files run last, as a group of their own, by the worker that has finished the files run in one process:
# a few minutes of launches (measured on 2 cores: 90, 58 and 31 s) that would otherwise wait behind the others.
LATE_LAUNCHES = ("test_trainer_mp.py", "test_torture.py", "test_lm_pipeline_mp.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    """With pytest-xdist (``make test`` runs ``-n 2 --dist loadgroup``): the launches of real processes run
    one after another on one worker, first (they take longest and each uses the cores of several ranks), and
    every other test file runs whole on one worker, its module fixtures once. The launches are the longer
    share, so the files of ``LATE_LAUNCHES`` form a second group queued last, which the other worker takes
    once it has run the rest. In one process: as collected."""
    if not config.pluginmanager.hasplugin("xdist") or not config.getoption("numprocesses", None):
        return
    launches, late, others = [], [], []
    for item in items:
        if not item.get_closest_marker("multiprocess"):
            item.add_marker(pytest.mark.xdist_group(item.path.name))
            others.append(item)
        elif item.path.name in LATE_LAUNCHES:
            item.add_marker(pytest.mark.xdist_group("launches-late"))
            late.append(item)
        else:
            item.add_marker(pytest.mark.xdist_group("launches"))
            launches.append(item)
    items[:] = launches + others + late


def pytest_sessionstart(session: pytest.Session) -> None:
    """Every ``save_state``/``load_state`` collects garbage once (``checkpoint._in_step``); the objects the
    imports made (torch, transformers: about 95 ms per full collection here) are set aside so that a
    collection scans what the tests create, and the many checkpoints the suite takes stay cheap."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def isolated_from_distributed_state(monkeypatch: pytest.MonkeyPatch):
    """Strip inherited launcher variables, and destroy a process group a test leaves behind."""
    for name in list(os.environ):
        if name in DISTRIBUTED_VARS or name.startswith("ACCELERATE_"):
            monkeypatch.delenv(name)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate's process-wide state, reset before and after: several ``Accelerator`` objects in one process."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield AcceleratorState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
