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
    # pytest-xdist hands out its units largest first by their number of tests; the order set in
    # pytest_collection_modifyitems (longest first, by time) is kept instead.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


# The property grids (a test over many configurations) run a fixed sample in ``make test``, so the suite stays
# under 15 minutes on 2 cores; ``make test-full`` (ACCELERATE_STATEFUL_GRID=full) runs every configuration, and
# ACCELERATE_STATEFUL_GRID=<word> draws another sample. Real-process launches always run whole.
GRID_ENV = "ACCELERATE_STATEFUL_GRID"
GRID_WHOLE = 6  # a grid of up to this many configurations runs whole
GRID_SHARE = 4  # of a larger one, one configuration in this many (at least GRID_WHOLE)


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


# Seconds each test file takes on the 2-core machine, roughly (measured with ``--durations=0``; a file not named
# here: DEFAULT_S). Only used to order the units of work longest first (``pytest_collection_modifyitems``).
COST_S = {"test_check_resume.py": 119, "test_check_resume_processes.py": 109, "test_demo.py": 94,
          "test_hf_datasets.py": 84, "test_endings.py": 75, "test_streams.py": 74, "test_lm_pipeline_mp.py": 55,
          "test_trainer_mp.py": 45, "test_docs.py": 45, "test_bitwise.py": 45, "test_stream_blocks.py": 43,
          "test_checkpoints_mp.py": 42, "test_stream_workers_elastic.py": 36, "test_conformance.py": 36,
          "test_elastic_mp.py": 35, "test_skip_streams.py": 31, "test_mixture_loader.py": 30,
          "test_logical_shards.py": 28, "test_hf_streams_as_written.py": 27, "test_sampler_rng.py": 24,
          "test_check_resume_points.py": 22, "test_mp_harness.py": 22, "test_conformance_table.py": 20,
          "test_grid_mp.py": 19, "test_deepspeed.py": 19, "test_torture.py": 16, "test_agree_mp.py": 15,
          "test_cli_imports.py": 15, "test_pipeline_rng.py": 15, "test_failures_mp.py": 13,
          "test_replicated_elastic.py": 13, "test_dist.py": 10,
          # SPLIT files: a test each (a test of theirs not named here: 1 s)
          "test_multiprocess.py[sources-world3]": 80, "test_multiprocess.py[world3]": 67,
          "test_multiprocess.py[sources-world2]": 66, "test_multiprocess.py[world2]": 54,
          "test_multiprocess.py[sources-world1]": 27, "test_multiprocess.py[world1]": 12,
          "test_lifecycle_mp.py[world2]": 47, "test_lifecycle_mp.py[world3]": 46}
DEFAULT_S = 5
# The launch and the file that open most of mosaicml-streaming's StreamingDatasets (its shared memory is claimed
# by a race between jobs: mp_grid.py): one unit, one after the other on one worker.
SHARED_MEMORY = ("test_grid_mp.py", "test_object_store_sources.py")
# Files whose tests launch one each and share no module fixture: each test is a unit of its own.
SPLIT = ("test_multiprocess.py", "test_lifecycle_mp.py")


def _unit(nodeid: str) -> str:
    """The unit of work a test belongs to: its file (its module fixtures run once), but for SPLIT."""
    name = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    if name in SPLIT:
        return nodeid
    return "+".join(SHARED_MEMORY) if name in SHARED_MEMORY else name


def _cost(unit: str) -> float:
    if "::" in unit:  # a test of a SPLIT file
        name, _, test = unit.partition("::")
        return COST_S.get(name.rsplit("/", 1)[-1] + test[test.find("["):], 1) if "[" in test else 1
    return sum(COST_S.get(name, DEFAULT_S) for name in unit.split("+"))


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which the nox sessions run without
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadgroup`` (``make test``) hands out the units of :func:`_unit`, in the order of the collection.

    pytest-xdist's own loadgroup reads ``xdist_group`` marks into the tests' ids, which pytest 9.2 no longer lets
    it change: every test was then a unit of its own, and a file's module fixtures ran again on each worker."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return ByUnit(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    """Grids sampled (above). Under pytest-xdist (``make test`` runs ``-n 2 --dist loadgroup``): the units of
    work (:func:`_unit`) longest first, which :func:`pytest_xdist_make_scheduler` hands out in that order, each
    to the worker that runs out of work first. In one process: as collected."""
    _sample_grids(config, items)
    if not hasattr(config, "workerinput"):  # an xdist worker collects; its controller and a lone pytest do not
        return
    units: dict = {}
    for item in items:
        units.setdefault(_unit(item.nodeid), []).append(item)
    items[:] = []
    for name in sorted(units, key=lambda name: (-_cost(name), name)):
        # the grid's launch before the other file of its unit (a stable sort keeps the rest as collected)
        items.extend(sorted(units[name], key=lambda item: item.path.name != SHARED_MEMORY[0]))


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
