"""Damaged, foreign and hostile checkpoints: refused with the file, the field and the fix, before anything changes.

One process writes two checkpoints with ``accelerator.save_state`` (``checkpoint_0``
after one batch, ``checkpoint_1`` after three) holding two loaders: a shuffled
map-style one and an iterable one whose dataset state holds a tensor (so the
checkpoint has a safetensors file too). Each case damages a copy of
``checkpoint_1`` (or loads it into a run configured differently) and requires that
``load_state`` raises the expected error, whose message names the file, the
field and the fix, while the model, the loaders' positions and the dataset
(no sample read) are untouched.

Damage to a file listed in the manifest is caught by the manifest (size or
SHA-256): such a checkpoint is *incomplete*, and ``resume()`` skips it for
``checkpoint_0``. The same damage with the manifest written again afterwards
("resealed": a bad write that was then sealed, or a hand edit that re-ran the
manifest) reaches the content checks; the checkpoint is complete, and
``resume()`` raises rather than quietly going back to an older one (which would
also hide a changed configuration).
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import pytest
import torch
from safetensors.torch import save as st_save
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
from torch.utils.data import DataLoader, Dataset, IterableDataset

from accelerate_stateful import Accelerator, CheckpointError, StateMismatchError, UnsupportedConfigError
from accelerate_stateful.checkpoint import _files, _integrity

N, BATCH, SEED = 22, 4, 0
STATE = Path(_files.SUBDIR)
JSON0, JSON1 = STATE / "loader_0.rank_0.json", STATE / "loader_1.rank_0.json"
TENSORS1 = STATE / "loader_1.rank_0.safetensors"
MANIFEST = STATE / _files.MANIFEST


class CountingIds(Dataset):
    """Sample ``i`` is ``i``; counts every read, so a test can prove nothing was read."""

    def __init__(self, n: int) -> None:
        self.n, self.reads = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.reads += 1
        return i


class NoisyStream(IterableDataset):
    """A stateful stream whose state holds a generator state (a tensor, hence a safetensors file)."""

    def __init__(self, n: int = 9) -> None:
        self.n, self.pos, self.generator = n, 0, torch.Generator().manual_seed(3)

    def state_dict(self) -> dict:
        return {"pos": self.pos, "rng": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]
        self.generator.set_state(state["rng"])

    def __iter__(self):
        while self.pos < self.n:
            torch.rand(1, generator=self.generator)  # the generator moves with the stream
            self.pos += 1
            yield self.pos - 1


class Run(NamedTuple):
    accelerator: Accelerator
    model: torch.nn.Module
    loader: object
    stream_loader: object
    dataset: CountingIds


def start(root: Path, n: int = N, batch_size: int = BATCH, seed: int = SEED, shuffle: bool = True,
          stream_batch_size: int = 2) -> Run:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(
        cpu=True,
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True, dispatch_batches=False),
        project_config=ProjectConfiguration(project_dir=str(root), automatic_checkpoint_naming=True),
    )
    dataset = CountingIds(n)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=torch.Generator().manual_seed(seed))
    model, _, loader, stream_loader = accelerator.prepare(model, optimizer, dl,
                                                                DataLoader(NoisyStream(), batch_size=stream_batch_size))
    return Run(accelerator, model, loader, stream_loader, dataset)


def set_weight(model: torch.nn.Module, value: float) -> None:
    with torch.no_grad():
        model.weight.fill_(value)
        model.bias.fill_(value)


pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """A project with ``checkpoint_0`` (weights 1, one batch taken) and ``checkpoint_1`` (weights 2, three)."""
    root = tmp_path_factory.mktemp("written")
    run = start(root)
    it, stream_it = iter(run.loader), iter(run.stream_loader)
    next(it), next(stream_it)
    set_weight(run.model, 1.0)
    run.accelerator.save_state()
    next(it), next(it), next(stream_it)
    set_weight(run.model, 2.0)
    run.accelerator.save_state()
    del it, stream_it
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    assert (root / "checkpoints" / "checkpoint_1" / TENSORS1).is_file()
    return root


@pytest.fixture
def project(written: Path, tmp_path: Path) -> Path:
    shutil.copytree(written, tmp_path / "project")
    return tmp_path / "project"


# --------------------------------------------------------------------------- damage
def _edit_json(rel: Path, **changes) -> Callable[[Path], None]:
    def edit(checkpoint: Path) -> None:
        tree = json.loads((checkpoint / rel).read_text())
        for key, change in changes.items():
            tree[key] = change(tree[key]) if callable(change) else change
        (checkpoint / rel).write_text(json.dumps(tree, sort_keys=True))
    return edit


def _truncate(rel: Path) -> Callable[[Path], None]:
    return lambda checkpoint: (checkpoint / rel).write_bytes((checkpoint / rel).read_bytes()[:25])


def _garbage(rel: Path) -> Callable[[Path], None]:
    def damage(checkpoint: Path) -> None:
        size = (checkpoint / rel).stat().st_size
        (checkpoint / rel).write_bytes(bytes((7 * i) % 256 for i in range(size)))  # same size: only the hash tells
    return damage


class Marker:
    """Unpickling this creates the marker file: proof that something was unpickled."""

    path: Optional[Path] = None

    def __reduce__(self):
        return (open, (str(Marker.path), "w"))


def _pickle_in_place(rel: Path, torch_format: bool = False) -> Callable[[Path], None]:
    def damage(checkpoint: Path) -> None:
        if torch_format:
            torch.save({"t": torch.zeros(2), "payload": Marker()}, checkpoint / rel)
        else:
            (checkpoint / rel).write_bytes(pickle.dumps({"format_version": 1, "payload": Marker()}))
    return damage


def _edit_manifest(**changes) -> Callable[[Path], None]:
    def edit(checkpoint: Path) -> None:
        manifest = json.loads((checkpoint / MANIFEST).read_text())
        for key, change in changes.items():
            manifest[key] = change(manifest[key]) if callable(change) else change
        manifest[_integrity.CHECKSUM] = _integrity.checksum(manifest)  # consistent, as a faulty writer's would be
        (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    return edit


def _as_two_ranks(checkpoint: Path) -> None:
    """Make it a checkpoint of two processes whose rank 1 files are lost, and seal it again."""
    for rel in (JSON0, JSON1):
        _edit_json(rel, topology=lambda t: {**t, "world_size": 2})(checkpoint)
    _files.write_manifest(checkpoint, world_size=2, num_loaders=2)


def _grow_size(rel: str) -> Callable[[dict], dict]:
    return lambda files: {**files, rel: {**files[rel], "size": files[rel]["size"] + 1}}


class Case(NamedTuple):
    damage: Optional[Callable[[Path], None]]
    error: type
    matches: tuple  # file, field, fix (regexes, all required)
    resealed: bool = False  # the manifest is written again after the damage
    config: dict = {}  # the loading run's settings, where they differ
    resume: str = "raises"  # or "falls back": resume() skips the damaged checkpoint


# Every message must say what to do, in one of these words.
FIX = (r"resume from (another|an earlier) checkpoint|upgrade accelerate-stateful|pass the same|"
       r"prepare the same loaders|start a fresh run")


HASH_FIX = "resume from another checkpoint"

CASES = {
    # ---- a loader state file damaged; the manifest, written before, catches it
    "truncated/stale-manifest": Case(_truncate(JSON0), CheckpointError,
                                     ("loader_0.rank_0.json", "bytes, its manifest says", "truncated", HASH_FIX),
                                     resume="falls back"),
    "truncated/resealed": Case(_truncate(JSON0), CheckpointError,
                               ("loader_0.rank_0.json", "not a valid JSON loader state", HASH_FIX), resealed=True),
    "not-json/stale-manifest": Case(_garbage(JSON0), CheckpointError,
                                    ("loader_0.rank_0.json", "does not match the hash", HASH_FIX), resume="falls back"),
    "not-json/resealed": Case(_garbage(JSON0), CheckpointError,
                              ("loader_0.rank_0.json", "not a valid JSON loader state", HASH_FIX), resealed=True),
    "format-version/stale-manifest": Case(_edit_json(JSON0, format_version=9), CheckpointError,
                                          ("loader_0.rank_0.json", "hash", HASH_FIX), resume="falls back"),
    "format-version/resealed": Case(_edit_json(JSON0, format_version=9), UnsupportedConfigError,
                                    ("loader_0.rank_0.json", "format_version=9,", "upgrade accelerate-stateful"),
                                    resealed=True),
    "missing-rank-file/stale-manifest": Case(lambda c: (c / JSON0).unlink(), CheckpointError,
                                             ("loader_0.rank_0.json", "listed in its manifest but missing",
                                              "incomplete"), resume="falls back"),
    "missing-rank-file/resealed": Case(lambda c: (c / JSON0).unlink(), CheckpointError,
                                       ("loader_0.rank_0.json is missing", "rank 0", "written by another number"),
                                       resealed=True),
    "missing-rank-file/two-rank-checkpoint": Case(_as_two_ranks, CheckpointError,
                                                  ("loader_0.rank_1.json is missing", "rank 1",
                                                   "another number of processes")),
    "manifest-world-size-disagrees-with-states": Case(_edit_manifest(world_size=2), CheckpointError,
                                                      ("MANIFEST.json", "world_size", "loader_0.rank_0.json")),
    # ---- hand edits that leave the JSON valid but the position impossible
    "off-step-boundary/stale-manifest": Case(_edit_json(JSON0, samples_consumed=lambda v: v + 1), CheckpointError,
                                             ("loader_0.rank_0.json", "hash", HASH_FIX), resume="falls back"),
    "off-step-boundary/resealed": Case(_edit_json(JSON0, samples_consumed=lambda v: v + 1), UnsupportedConfigError,
                                       ("loader_0.rank_0.json", "inconsistent position", "samples_consumed",
                                        HASH_FIX), resealed=True),
    "batches-yielded-disagree/resealed": Case(_edit_json(JSON0, batches_yielded=lambda v: v + 1),
                                              UnsupportedConfigError,
                                              ("loader_0.rank_0.json", "batches_yielded=4", "samples_consumed=12",
                                               HASH_FIX), resealed=True),
    "negative-epoch/resealed": Case(_edit_json(JSON0, epoch=-1), UnsupportedConfigError,
                                    ("loader_0.rank_0.json", "negative 'epoch'", HASH_FIX), resealed=True),
    "epoch-wrong-type/resealed": Case(_edit_json(JSON0, epoch="0"), UnsupportedConfigError,
                                      ("loader_0.rank_0.json", "invalid 'epoch'", HASH_FIX), resealed=True),
    "topology-invalid/resealed": Case(_edit_json(JSON0, topology=lambda t: {**t, "rank": 5}), UnsupportedConfigError,
                                      ("loader_0.rank_0.json", "invalid topology"), resealed=True),
    # a state claiming 2 processes in a checkpoint whose manifest says 1: without the check, a position that
    # happens to fall on a step boundary of 2 processes would load as an elastic resume from rank 0 alone
    "topology-another-world-size/resealed": Case(_edit_json(JSON0, topology=lambda t: {**t, "world_size": 2}),
                                                 CheckpointError, ("loader_0.rank_0.json", "MANIFEST.json",
                                                                   "world_size=1"), resealed=True),
    # ---- pickles where our files should be: refused, and never unpickled
    "pickle-for-json/stale-manifest": Case(_pickle_in_place(JSON0), CheckpointError,
                                           ("loader_0.rank_0.json", "bytes, its manifest says", HASH_FIX),
                                           resume="falls back"),
    "pickle-for-json/resealed": Case(_pickle_in_place(JSON0), CheckpointError,
                                     ("loader_0.rank_0.json", "not a valid JSON loader state", HASH_FIX),
                                     resealed=True),
    "pickle-for-safetensors/stale-manifest": Case(_pickle_in_place(TENSORS1, torch_format=True), CheckpointError,
                                                  ("loader_1.rank_0.safetensors", "manifest says", HASH_FIX),
                                                  resume="falls back"),
    "pickle-for-safetensors/resealed": Case(_pickle_in_place(TENSORS1, torch_format=True), CheckpointError,
                                            ("loader_1.rank_0.safetensors", "not a valid safetensors file",
                                             HASH_FIX), resealed=True),
    "safetensors-missing-tensor/resealed": Case(lambda c: (c / TENSORS1).write_bytes(st_save({})), CheckpointError,
                                                ("loader_1.rank_0.json", "refers to tensor", "safetensors file lacks"),
                                                resealed=True),
    "pickle-for-manifest": Case(_pickle_in_place(MANIFEST), CheckpointError,
                                ("MANIFEST.json", "is damaged", "resume from an earlier checkpoint"),
                                resume="falls back"),
    # ---- the manifest edited
    "manifest-size-of-loader-file": Case(_edit_manifest(files=_grow_size(JSON0.as_posix())), CheckpointError,
                                         ("loader_0.rank_0.json", "its manifest says", HASH_FIX),
                                         resume="falls back"),
    "manifest-size-of-model-file": Case(_edit_manifest(files=_grow_size("model.safetensors")), CheckpointError,
                                        ("model.safetensors", "its manifest says", HASH_FIX), resume="falls back"),
    # one state more than prepared waits for a loader prepared later (test_prepare_after_load.py): read at the load
    "manifest-loader-count": Case(_edit_manifest(num_loaders=3), CheckpointError,
                                  ("loader_2.rank_0.json", "is missing", HASH_FIX)),
    "manifest-missing": Case(lambda c: (c / MANIFEST).unlink(), CheckpointError,
                             ("MANIFEST.json", "incomplete", "resume from an earlier checkpoint"),
                             resume="falls back"),
    # ---- an intact checkpoint, written for another configuration
    "another-dataset-length": Case(None, StateMismatchError,
                                   ("loader_0.rank_0.json", r"len\(dataset\): saved 22, current 26",
                                    r"use the same len\(dataset\), samples per epoch .* or start a fresh run"),
                                   config={"n": 26}),
    # (the map-style loader resumes at another batch size, tests/test_rebatch.py; a stream inside its epoch cannot)
    "another-batch-size": Case(None, UnsupportedConfigError,
                               ("loader_1.rank_0.json", "written with batch_size=2, this run has batch_size=3",
                                "resume with batch_size=2 .* or start a fresh run"), config={"stream_batch_size": 3}),
    "another-seed": Case(None, StateMismatchError,
                         ("loader_0.rank_0.json", r"generator seed\): saved 0, current 1", "use the same data seed"),
                         config={"seed": 1}),
    "another-order": Case(None, StateMismatchError,
                          ("loader_0.rank_0.json", r"shuffle/sampler \(the epoch order\): saved 'random', current 'sequential'",
                           "use the same shuffle/sampler"), config={"shuffle": False}),
}


def _apply(project: Path, case: Case) -> Path:
    checkpoint = project / "checkpoints" / "checkpoint_1"
    if case.damage is not None:
        case.damage(checkpoint)
    if case.resealed:
        _files.write_manifest(checkpoint, world_size=1, num_loaders=2)
    return checkpoint


@pytest.mark.parametrize("name", list(CASES))
def test_a_damaged_or_foreign_checkpoint_is_refused_before_anything_changes(project, tmp_path, name):
    case = CASES[name]
    Marker.path = tmp_path / "unpickled"
    checkpoint = _apply(project, case)
    run = start(project, **case.config)
    set_weight(run.model, -1.0)
    positions = run.loader.state_dict(), run.stream_loader.state_dict()

    with pytest.raises(case.error) as info:
        run.accelerator.load_state(checkpoint)

    message = str(info.value)
    for pattern in case.matches + (FIX,):
        assert re.search(pattern, message), f"{pattern!r} not in: {message}"
    assert run.model.weight.item() == -1.0 and run.model.bias.item() == -1.0, "the model was loaded"
    assert (run.loader.state_dict(), run.stream_loader.state_dict()) == positions
    assert run.dataset.reads == 0, "samples were read"
    assert not Marker.path.exists(), "something was unpickled"


@pytest.mark.parametrize("name", list(CASES))
def test_resume_skips_an_incomplete_checkpoint_and_raises_on_a_complete_one_that_does_not_fit(project, tmp_path,
                                                                                               name):
    case = CASES[name]
    Marker.path = tmp_path / "unpickled"
    _apply(project, case)
    run = start(project, **case.config)
    set_weight(run.model, -1.0)
    if case.resume == "falls back":
        assert run.accelerator.resume() == project / "checkpoints" / "checkpoint_0"
        assert run.model.weight.item() == 1.0
        assert run.loader.batches_yielded == 1
    else:
        with pytest.raises(case.error):
            run.accelerator.resume()
        assert run.model.weight.item() == -1.0
    assert not Marker.path.exists(), "something was unpickled"


def test_after_falling_back_the_run_continues_exactly_from_the_older_checkpoint(project):
    full = [b.tolist() for b in start(project / "fresh").loader]
    _apply(project, CASES["truncated/stale-manifest"])
    run = start(project)
    assert run.accelerator.resume().name == "checkpoint_0"
    assert [b.tolist() for b in run.loader] == full[1:]
    # Numbering continues after the newest checkpoint present: the damaged one is never overwritten.
    assert run.accelerator.save_state().name == "checkpoint_2"
    assert _files.is_complete(project / "checkpoints" / "checkpoint_2")
    assert not _files.is_complete(project / "checkpoints" / "checkpoint_1")


def test_the_case_list_counts_what_docs_reliability_reports():
    falls_back = sum(case.resume == "falls back" for case in CASES.values())
    assert (len(CASES), falls_back, len(CASES) - falls_back) == (31, 11, 20)
