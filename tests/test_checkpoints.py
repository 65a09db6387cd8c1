"""Checkpoint handling in one process: versions, numbering and rotation, per-folder manifests, reads per rank.

The same rules with real processes (folders per process, a save on the main process only) are in
``test_checkpoints_mp.py``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
from torch.utils.data import DataLoader

from accelerate_stateful import Accelerator, CheckpointError, DistContext, UnsupportedConfigError
from accelerate_stateful.checkpoint import _files, _integrity
from accelerate_stateful.checkpoint import _resume
from accelerate_stateful.checkpoint._versions import refuse_unknown_version
from scripts import load_script

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

MANIFEST = Path(_files.SUBDIR) / _files.MANIFEST
UPGRADE = r"upgrade accelerate-stateful"


def start(project: Path, total_limit=None) -> tuple[Accelerator, object]:
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(
        cpu=True,
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
        project_config=ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True,
                                            total_limit=total_limit),
    )
    dl = DataLoader(list(range(24)), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))
    return accelerator, accelerator.prepare(dl)


def numbers(root: Path) -> list[int]:
    return sorted(_files.checkpoint_number(p) for p in _files.numbered_checkpoints(root))


# --------------------------------------------------------------------------- versions
def _edit(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    data[_integrity.CHECKSUM] = _integrity.checksum(data)  # consistent, as a faulty writer's would be
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("version", [2, 99, 0, -1, "1", True, None], ids=str)
def test_a_manifest_of_an_unknown_version_is_refused_by_load_state_and_resume(tmp_path, version):
    accelerator, dl = start(tmp_path)
    older = accelerator.save_state()
    next(iter(dl))
    newer = accelerator.save_state()
    _edit(newer / MANIFEST, manifest_version=version)
    expected = rf"manifest_version={version!r}, which this release cannot read.*reads manifest_version 1: {UPGRADE}"
    with pytest.raises(CheckpointError, match=expected):
        accelerator.load_state(newer)
    with pytest.raises(CheckpointError, match=expected):
        accelerator.resume()  # never falls back to the older checkpoint without a word
    with pytest.raises(CheckpointError, match=expected):
        _files.read_manifest(newer)
    assert not _files.is_complete(newer) and _files.is_complete(older)


@pytest.mark.parametrize("version", [2, 0, -1], ids=str)
def test_a_loader_state_of_an_unknown_format_version_is_refused(tmp_path, version):
    accelerator, _ = start(tmp_path)
    path = accelerator.save_state()
    _edit(_files.state_file(path, 0, 0), format_version=version)
    _files.write_manifest(path, world_size=1, num_loaders=1)  # sealed again: only the version is wrong
    with pytest.raises(UnsupportedConfigError, match=rf"format_version={version!r}.*reads format_version 1: {UPGRADE}"):
        accelerator.load_state(path)


def test_every_versioned_reader_accepts_only_the_versions_it_lists():
    refuse_unknown_version("manifest_version", 2, (1, 2), "here")
    with pytest.raises(CheckpointError, match=r"here has manifest_version=3, .*newer release.*reads manifest_version 1, 2"):
        refuse_unknown_version("manifest_version", 3, (1, 2), "here")


# --------------------------------------------------------------------------- numbering and rotation
STARTS = ["fresh", "resume", "load_state", "load_state(older)"]


def _restart(project: Path, how: str, limit):
    accelerator, dl = start(project, total_limit=limit)
    complete = list(_files.complete_checkpoints(project / "checkpoints"))
    if how == "resume":
        accelerator.resume()
    elif how == "load_state" and complete:
        accelerator.load_state()  # Accelerate's usual call: the newest, found by the package
    elif how == "load_state(older)" and complete:
        accelerator.load_state(complete[-1])  # an explicit, older checkpoint
    return accelerator, dl


@pytest.mark.parametrize("limit", [None, 1, 2, 3], ids=lambda v: f"total_limit={v}")
@pytest.mark.parametrize("seed", range(4))
def test_the_checkpoint_just_written_always_exists_and_is_the_newest(tmp_path, limit, seed):
    """Over random sequences of restarts (fresh, resume(), load_state(), load_state(older)) and saves."""
    rng = random.Random(seed)
    root = tmp_path / "checkpoints"
    written = []
    for how in [rng.choice(STARTS) for _ in range(4)]:
        accelerator, dl = _restart(tmp_path, how, limit)
        it = iter(dl)
        for _ in range(rng.randint(1, 3)):
            next(it, None)
            path = accelerator.save_state()
            assert _files.is_complete(path), f"{how}: save_state returned {path}, which is not a complete checkpoint"
            assert numbers(root)[-1] == _files.checkpoint_number(path), f"{how}: {path.name} is not the newest"
            assert not written or _files.checkpoint_number(path) > written[-1], f"{how}: numbering went back"
            written.append(_files.checkpoint_number(path))
        del it
        complete = list(_files.complete_checkpoints(root))
        assert limit is None or len(complete) <= limit
    assert written == list(range(len(written)))


def test_load_state_then_save_state_continues_numbering_and_keeps_the_new_checkpoint(tmp_path):
    """The issue's case: resuming with Accelerate's load_state(), then saving with total_limit."""
    accelerator, _ = start(tmp_path, total_limit=2)
    for _ in range(3):
        accelerator.save_state()
    accelerator, _ = start(tmp_path, total_limit=2)
    accelerator.load_state()
    paths = [accelerator.save_state() for _ in range(2)]
    assert [p.name for p in paths] == ["checkpoint_3", "checkpoint_4"]
    assert all(p.exists() for p in paths)
    assert numbers(tmp_path / "checkpoints") == [3, 4]


def test_a_sealed_checkpoint_is_never_overwritten_even_when_iteration_points_at_it(tmp_path):
    accelerator, _ = start(tmp_path)
    first = accelerator.save_state()
    accelerator.project_configuration.iteration = 0
    assert accelerator.save_state().name == "checkpoint_1"
    assert _files.is_complete(first)


# --------------------------------------------------------------------------- folders holding some ranks
def _as_folder_of_rank_0_of_2(path: Path) -> None:
    """What a folder of rank 0 looks like when each of 2 processes saved into a folder of its own."""
    _edit(_files.state_file(path, 0, 0), topology={**json.loads(_files.state_file(path, 0, 0).read_text())["topology"],
                                                   "world_size": 2})
    _files.write_manifest(path, world_size=2, num_loaders=1, ranks=[0])


def test_an_elastic_resume_from_a_folder_holding_some_ranks_is_refused_with_the_reason(tmp_path):
    accelerator, dl = start(tmp_path)
    next(iter(dl))
    path = accelerator.save_state()
    _as_folder_of_rank_0_of_2(path)
    position = dl.state_dict()
    with pytest.raises(CheckpointError, match=r"needs the state of every rank.*holds only ranks \[0\].*resume it on 2 "
                                              r"processes"):
        accelerator.load_state(path)
    assert dl.state_dict() == position


def test_a_manifest_listing_ranks_outside_its_world_is_damaged(tmp_path):
    accelerator, _ = start(tmp_path)
    path = accelerator.save_state()
    _edit(path / MANIFEST, ranks=[0, 3])
    with pytest.raises(CheckpointError, match="is damaged.*outside a world of 1"):
        accelerator.load_state(path)


# --------------------------------------------------------------------------- reads per rank
@pytest.mark.parametrize("world", [2, 4, 16])
def test_each_rank_reads_a_constant_number_of_files_and_one_rank_verifies_the_folder(tmp_path, world):
    """Simulated ranks: at the saved world size every rank but the verifying one opens the manifest and its
    own state, whatever the world size."""
    checkpoint, loaders, _ = load_script("benchmarks/bench_scale.py", "bench_scale").save_simulated(tmp_path, world)
    reads = []
    for rank in range(world):
        _files.IO.clear()
        manifest = _files.load_manifest(checkpoint)
        if rank == 0:
            _files.verify_files(checkpoint, manifest)
        _resume.read_states(DistContext(rank, world), checkpoint, manifest, [loaders[rank]])
        reads.append(dict(_files.IO))
    assert all(r == {"open": 2, "stat": 2} for r in reads[1:]), reads
    assert reads[0]["open"] == 2 + world  # the manifest, the hash of every loader file, its own state
