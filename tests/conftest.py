"""Shared test set-up: the ``multiprocess`` marker, every test isolated from distributed state, and a fresh
Accelerate state for tests that build ``Accelerator`` objects."""

from __future__ import annotations

import gc
import hashlib
import logging
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


# The property grids (a test over many configurations) run a fixed sample in ``make test``, so the suite stays
# under 15 minutes on 2 cores; ``make test-full`` (ACCELERATE_STATEFUL_GRID=full) runs every configuration, and
# ACCELERATE_STATEFUL_GRID=<word> draws another sample. Real-process launches always run whole.
GRID_ENV = "ACCELERATE_STATEFUL_GRID"
GRID_WHOLE = 8  # a grid of up to this many configurations runs whole
GRID_SHARE = 3  # of a larger one, one configuration in this many (at least GRID_WHOLE)


def _sample_grids(config: pytest.Config, items: list) -> None:
    salt = os.environ.get(GRID_ENV, "")
    if salt == "full":
        return
    grids: dict = {}
    for item in items:
        if getattr(item, "callspec", None) is not None and not item.get_closest_marker("multiprocess"):
            grids.setdefault((item.path, item.originalname), []).append(item)
    left_out = set()
    for grid in grids.values():
        keep = max(GRID_WHOLE, -(-len(grid) // GRID_SHARE))
        ranked = sorted(grid, key=lambda item: hashlib.sha1(f"{salt}{item.nodeid}".encode()).hexdigest())
        left_out.update(id(item) for item in ranked[keep:])
    if left_out:
        config.hook.pytest_deselected(items=[item for item in items if id(item) in left_out])
        items[:] = [item for item in items if id(item) not in left_out]


def pytest_report_header(config: pytest.Config) -> str:
    salt = os.environ.get(GRID_ENV, "")
    if salt == "full":
        return "property grids: every configuration (ACCELERATE_STATEFUL_GRID=full)"
    return (f"property grids: a fixed sample, at least {GRID_WHOLE} and 1 in {GRID_SHARE} configurations of each "
            f"(sample '{salt}'; make test-full runs every one)")


# Seconds the launches of a test file take on the 2-core machine, roughly (measured; a file not named here:
# DEFAULT_LAUNCH_S). Only used to split the launches into two halves of about equal time, one per pytest worker.
# A file goes whole to one half (its module fixtures launch once), but for those in SPLIT, whose tests launch
# one each: there each test is a unit, of its file's time divided among them.
LAUNCH_S = {"test_multiprocess.py": 380, "test_trainer_mp.py": 200, "test_lifecycle_mp.py": 160, "test_torture.py": 150,
            "test_elastic_mp.py": 150, "test_demo.py": 140, "test_endings.py": 100, "test_lm_pipeline_mp.py": 100,
            "test_bitwise.py": 85, "test_check_resume.py": 70, "test_quickstart.py": 75, "test_deepspeed.py": 70,
            "test_checkpoints_mp.py": 65, "test_grid_mp.py": 60, "test_sharded.py": 45,
            "test_failures_mp.py": 45}
DEFAULT_LAUNCH_S = 20
# The launch and the file that open most of mosaicml-streaming's StreamingDatasets (its shared memory is claimed
# by a race between jobs: mp_grid.py): one after the other on one worker.
SHARED_MEMORY = ("test_grid_mp.py", "test_object_store_sources.py")
# (Not test_check_resume.py: its tests share a module fixture, which each half would run again.)
SPLIT = ("test_multiprocess.py", "test_lifecycle_mp.py")


def _two_halves(launches: list) -> list[str]:
    """Each launch test's group, ``launches-0`` or ``launches-1``: the longest unit first, each to the lighter
    half."""
    units: dict = {}
    for item in launches:
        name = item.path.name
        units.setdefault(item.nodeid if name in SPLIT else name, []).append(item)
    per_file = {name: sum(1 for item in launches if item.path.name == name) for name in SPLIT}
    def cost(unit: str) -> float:
        name = units[unit][0].path.name
        return LAUNCH_S.get(name, DEFAULT_LAUNCH_S) / (per_file[name] if name in SPLIT else 1)
    totals, group = [0.0, 0.0], {}
    for unit in sorted(units, key=lambda unit: (-cost(unit), unit)):
        half = totals.index(min(totals))
        totals[half] += cost(unit)
        group.update((id(item), f"launches-{half}") for item in units[unit])
    return [group[id(item)] for item in launches]


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    """Grids sampled (above). With pytest-xdist (``make test`` runs ``-n 2 --dist loadgroup``): the launches
    of real processes run first, in two halves of about equal time, one after another on each worker (a rank
    waits on its peers and on files as much as it computes: two launches at once keep both cores busy), and
    every other test file runs whole on one worker, its module fixtures once. In one
    process: as collected."""
    _sample_grids(config, items)
    if not config.pluginmanager.hasplugin("xdist") or not config.getoption("numprocesses", None):
        return
    launches = [item for item in items if item.get_closest_marker("multiprocess")]
    others = [item for item in items if not item.get_closest_marker("multiprocess")]
    halves = _two_halves(launches)
    for item, group in zip(launches, halves):
        item.add_marker(pytest.mark.xdist_group(group))
    alongside = next((group for item, group in zip(launches, halves) if item.path.name == SHARED_MEMORY[0]), None)
    for item in others:
        shares = alongside is not None and item.path.name in SHARED_MEMORY
        item.add_marker(pytest.mark.xdist_group(alongside if shares else item.path.name))
    items[:] = launches + others


def pytest_collection_finish(session: pytest.Session) -> None:
    """A ``save_state``/``load_state`` with a pass open collects garbage once (``checkpoint._in_step``); the
    objects the imports made (torch, transformers: about 95 ms per full collection here) are set aside so that a
    collection scans what the tests create, and the many checkpoints the suite takes stay cheap."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="module", autouse=True)
def set_aside_what_earlier_modules_left():
    """The same at the start of each test file, before its own fixtures: what the files before it imported
    lazily (Accelerate's checkpoint code, torch's operators: tens of thousands of objects, 0.1 s and more per
    collection) is set aside. What survives a collection here is what the process keeps for good."""
    gc.collect()
    gc.freeze()
    yield


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


@pytest.fixture
def quiet_datasets():
    """``datasets`` warns on every resume of a shuffle buffer and about idle workers; the tests check both."""
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)
