"""Reading a checkpoint for the command-line tool: what is there, and everything wrong with it.

Loading refuses a checkpoint at its first problem; a person looking at one wants
to see all of them, and to see what an incomplete checkpoint does hold. This
module reads through the package's own functions (``_files``, ``_state``), so
every problem is reported in the words a resume would use, and nothing is
ever unpickled (Accelerate's ``.pkl`` files are never opened). Nothing here
imports torch: a state's tensors are checked by safetensors' own parser and
stand in the state as :class:`SavedTensor` (the tool never looks inside them).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import safetensors

from ..checkpoint import _files, _integrity
from ..checkpoint import _state as S
from ._position import KINDS, is_map_style
from ..errors import CheckpointError, StatefulLoaderError, UnsupportedConfigError

# Where Accelerate's automatic checkpoint naming puts a project's checkpoints: <project_dir>/checkpoints/.
_PROJECT_CHECKPOINTS = "checkpoints"
_LOADER_FILE = re.compile(r"^loader_(\d+)\.rank_(\d+)\.json$")


class UnreadableCheckpoint(CheckpointError):
    """The input cannot be read as a checkpoint at all; the message says why and what to do."""


class NotAnswerable(StatefulLoaderError):
    """The question cannot be answered from this checkpoint alone (a stream, a user's own sampler).

    Raised to the command line only, which turns it into its own exit status.
    """


def require_drawable_order(states: list) -> None:
    """Raise ``NotAnswerable`` if an order in ``states`` (a dispatcher's: its reader's) was drawn by the
    ``DataLoader``'s own sampler, whose draws a checkpoint does not record; reads the states only (no torch)."""
    for state in states:
        config = state.get(S.CONFIG) if isinstance(state, Mapping) else None
        base = state.get(S.BASE) if isinstance(state, Mapping) else None
        if isinstance(base, Mapping) and isinstance(base.get(S.CONFIG), Mapping):
            config = base[S.CONFIG]
        kind = config.get("order") if isinstance(config, Mapping) else None
        if isinstance(kind, str) and kind.startswith("sampler:"):
            raise NotAnswerable(sampler_refusal(kind))


def sampler_refusal(kind: str) -> str:
    return (f"the epoch order comes from the DataLoader's own sampler ({kind}), which a checkpoint does not record; "
            "dataset indices can be listed only for sequential and shuffle=True loaders")


def require_map_style(state: Any) -> None:
    """Raise ``NotAnswerable`` (``samples``) unless ``state`` is of a loader over a map-style dataset."""
    if not is_map_style(state):
        raise NotAnswerable(
            f"this loader reads a stream (mode {state[S.MODE]!r}): a stream has no dataset indices to list; "
            "samples answers only for map-style datasets"
        )


@dataclass(frozen=True)
class SavedTensor:
    """A tensor of a loader state, as its safetensors file describes it (the command line reads no values)."""

    dtype: str
    shape: tuple


def _tensor_specs(raw: bytes) -> dict:
    """The tensors of a safetensors file, parsed and checked by safetensors itself, without torch."""
    return {name: SavedTensor(spec["dtype"], tuple(spec["shape"])) for name, spec in safetensors.deserialize(raw)}


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint: the file it concerns (relative, or ``None``) and the message."""

    file: Optional[str]
    message: str


@dataclass
class Checkpoint:
    """What a checkpoint folder holds, read without trusting it.

    Attributes:
        path: The checkpoint folder.
        manifest: The parsed manifest, or ``None`` when it is missing or unreadable.
        world_size: From the manifest, else the ranks found on disk.
        num_loaders: From the manifest, else the loaders found on disk.
        states: ``{(loader, rank): state}`` of every loader file that could be read and checked.
        problems: Everything that makes the checkpoint incomplete or damaged; empty when it is sound.
        load_tensors: How a state's tensors are read (``None``: as torch tensors).
    """

    path: Path
    manifest: Optional[dict] = None
    world_size: int = 0
    num_loaders: int = 0
    states: dict = field(default_factory=dict)
    problems: list = field(default_factory=list)
    load_tensors: Optional[Callable[[bytes], dict]] = field(default=_tensor_specs, repr=False)

    @property
    def complete(self) -> bool:
        return not self.problems

    def rank_states(self, loader: int) -> list[Any]:
        """Every saved rank's state of ``loader``, in rank order; raises if one could not be read."""
        missing = [r for r in range(self.world_size) if (loader, r) not in self.states]
        if missing:
            found = next((p.message for p in self.problems if p.file and f"loader_{loader}.rank_" in p.file), None)
            raise UnreadableCheckpoint(
                found or f"{self.path}: loader {loader} has no readable state for rank(s) {missing}; "
                "resume from another checkpoint"
            )
        return [self.states[(loader, r)] for r in range(self.world_size)]


def open_checkpoint(path: Path, with_tensors: bool = False, hashes: bool = False) -> Checkpoint:
    """Read ``path`` as a checkpoint; raises :class:`UnreadableCheckpoint` when it is not one at all.

    A state's tensors are :class:`SavedTensor` descriptions, or torch tensors ``with_tensors`` (for loaders
    rebuilt from the states, which need them; this imports torch). Every listed file is checked for its
    size, and ``hashes`` for its hash too (reading every byte of the checkpoint).
    """
    path = Path(path)
    _refuse_non_checkpoint(path)
    ckpt = Checkpoint(path, load_tensors=None if with_tensors else _tensor_specs)
    _read_manifest(ckpt, hashes)
    found = _loader_files(path)
    if ckpt.manifest is None:
        ckpt.world_size = 1 + max((rank for _, rank in found), default=-1)
        ckpt.num_loaders = 1 + max((loader for loader, _ in found), default=-1)
    for loader in range(ckpt.num_loaders):
        for rank in range(ckpt.world_size):
            _read_state(ckpt, loader, rank)
    return ckpt


def _refuse_non_checkpoint(path: Path) -> None:
    if not path.exists():
        raise UnreadableCheckpoint(f"{path} does not exist; pass the folder save_state() wrote")
    if not path.is_dir():
        raise UnreadableCheckpoint(f"{path} is a file, not a checkpoint folder; pass the folder save_state() wrote")
    if (path / _files.SUBDIR).is_dir():
        return
    raise UnreadableCheckpoint(
        f"{path} is not an accelerate-stateful checkpoint: it has no {_files.SUBDIR}/ folder (was it saved by "
        f"accelerate_stateful.Accelerator with use_stateful_dataloader=True?){_hint(path)}"
    )


def _hint(path: Path) -> str:
    """Where the checkpoint folders are, when ``path`` holds them or is the project folder above them."""
    newest = _files.latest_checkpoint(path)
    if newest is not None:
        return f"; it holds checkpoint folders, pass one of them, e.g. {newest} (the newest complete one)"
    project = path / _PROJECT_CHECKPOINTS
    if project.is_dir() and _files.numbered_checkpoints(project):
        newest = _files.latest_checkpoint(project)
        pick = f"; the newest complete one is {newest}" if newest is not None else "; none of them is complete"
        return f"; did you mean {project}? It holds the checkpoint folders of this project{pick}"
    return ""


def _read_manifest(ckpt: Checkpoint, hashes: bool) -> None:
    """Parse the manifest and check every file it lists, and the folder for unlisted ones, collecting each
    problem (the package stops at one)."""
    rel = f"{_files.SUBDIR}/{_files.MANIFEST}"
    try:
        manifest, damage = _files.load_manifest(ckpt.path), None
    except CheckpointError as exc:
        manifest, damage = _parse_manifest(ckpt.path / rel), Problem(rel, str(exc))
    if manifest is None:  # nothing to go by: the loader files found say what they can
        ckpt.problems.append(damage)
        return
    version = manifest.get("manifest_version")
    if not isinstance(version, int) or isinstance(version, bool):
        ckpt.problems.append(Problem(rel, (
            f"{ckpt.path / rel} has no valid manifest_version ({version!r}); the file is damaged, resume from an "
            "earlier checkpoint")))
        return
    if version > _files.MANIFEST_VERSION:
        raise UnreadableCheckpoint(
            f"{ckpt.path / rel} has manifest_version={version!r}, this accelerate-stateful reads up to "
            f"{_files.MANIFEST_VERSION}; it was written by a newer release: upgrade accelerate-stateful to read it"
        )
    ckpt.manifest = manifest
    ckpt.world_size, ckpt.num_loaders = int(manifest["world_size"]), int(manifest["num_loaders"])
    if damage is not None:  # first: what the damaged manifest says about the files is shown, not trusted
        ckpt.problems.append(damage)
    found = _integrity.problems(ckpt.path, manifest, hashes=hashes)
    ckpt.problems += [Problem(name, message) for name, message in found]


def _parse_manifest(path: Path) -> Optional[dict]:
    """The manifest's JSON when it has the fields every version has, else ``None`` (the problem is recorded)."""
    try:
        manifest = json.loads(path.read_text("utf-8"), parse_constant=_files._reject_constant)
        int(manifest["world_size"]), int(manifest["num_loaders"])
        if not all(isinstance(entry, dict) for entry in dict(manifest["files"]).values()):
            return None
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return None
    return manifest


def _loader_files(checkpoint: Path) -> list[tuple[int, int]]:
    found = (_LOADER_FILE.match(p.name) for p in (checkpoint / _files.SUBDIR).iterdir())
    return [(int(m.group(1)), int(m.group(2))) for m in found if m]


def _read_state(ckpt: Checkpoint, loader: int, rank: int) -> None:
    """Read and check one rank's state as a resume would; a problem is recorded, a future format refused."""
    path = _files.state_file(ckpt.path, loader, rank)
    rel = path.relative_to(ckpt.path).as_posix()
    try:
        state = _files.read_loader_state(ckpt.path, loader, rank, load_tensors=ckpt.load_tensors)
        S.check_shape(state, str(path))
    except UnsupportedConfigError as exc:
        if _from_future(state):
            raise UnreadableCheckpoint(str(exc)) from None
        _add_problem(ckpt, Problem(rel, str(exc)))
        return
    except CheckpointError as exc:
        _add_problem(ckpt, Problem(rel, str(exc)))
        return
    _refuse_unknown_modes(state, path)
    written = state[S.TOPOLOGY].get("world_size")
    if written != ckpt.world_size:
        ckpt.problems.append(Problem(rel, (
            f"{path} was written by world_size={written}, but the checkpoint has {ckpt.world_size} ranks; it mixes "
            "files of different runs, resume from another checkpoint")))
        return
    ckpt.states[(loader, rank)] = state


def _add_problem(ckpt: Checkpoint, problem: Problem) -> None:
    """Record a file's problem unless the manifest check already named that file (once per file is enough)."""
    if all(p.file != problem.file for p in ckpt.problems):
        ckpt.problems.append(problem)


def _from_future(state: Any) -> bool:
    version = state.get(S.VERSION) if isinstance(state, dict) else None
    return isinstance(version, int) and not isinstance(version, bool) and version > S.FORMAT_VERSION


def _refuse_unknown_modes(state: dict, path: Path) -> None:
    """A loader kind this release does not know was written by a newer one (or a dispatcher's reader was)."""
    reader = state.get(S.BASE) if state[S.MODE] == S.DISPATCH_MODE else None
    for mode in (state[S.MODE], reader.get(S.MODE) if isinstance(reader, dict) else None):
        if mode is not None and mode not in KINDS:
            raise UnreadableCheckpoint(
                f"{path} holds a loader of the unknown mode {mode!r} (this release knows {sorted(KINDS)}); it was "
                "written by a newer release: upgrade accelerate-stateful to read it"
            )
