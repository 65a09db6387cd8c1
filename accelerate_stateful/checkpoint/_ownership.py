"""Which checkpoint folders are this package's: the only ones it ever removes, reuses or writes into.

A save writes ``accelerate_stateful/SAVE_STARTED`` into its folder before anything else, and the manifest
(``accelerate_stateful/MANIFEST.json``) last. So every folder a save of this package touched carries one of
the two, even when the save was killed at its first file; a save killed while writing the marker leaves
nothing but this package's own subfolder, which is this package's too. A non-empty folder with none of these
was written by someone else (stock Accelerate or Trainer, the user): it is **foreign**. A foreign folder is never removed,
never reused and never written into, and the automatic numbering continues after it. An empty folder holds
nothing to lose and counts as neither.

Pure functions of one process's view of the disk; the ranks agree on them in ``_checkpoints``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from . import _files
from ..errors import CheckpointError

MARKER = "SAVE_STARTED"
_MARKER_CONTENT = b'{"writer": "accelerate-stateful"}\n'


def marker(folder: Path) -> Path:
    return Path(folder) / _files.SUBDIR / MARKER


def is_ours(folder: Path) -> bool:
    """Whether a save of this package began in ``folder`` (its marker), completed there (its manifest), or was
    killed while writing its marker (nothing in the folder but this package's own subfolder)."""
    if _files.has_manifest(folder) or marker(folder).is_file():
        return True
    folder = Path(folder)
    entries = [p.name for p in folder.iterdir()] if folder.is_dir() else []
    return entries == [_files.SUBDIR]


def is_foreign(folder: Path) -> bool:
    """Whether ``folder`` holds files that this package did not write (see the module docstring)."""
    folder = Path(folder)
    return folder.is_dir() and not is_ours(folder) and any(folder.iterdir())


def newest_foreign(root: Path) -> int:
    """The number of the newest foreign ``checkpoint_<N>`` under ``root``, or -1."""
    return next((_files.checkpoint_number(p) for p in _files.numbered_checkpoints(root) if is_foreign(p)), -1)


def foreign_among(paths: Iterable[Path]) -> list[Path]:
    return [Path(p) for p in paths if is_foreign(p)]


def write_marker(folder: Path) -> None:
    """Mark ``folder`` as this package's before anything else is written into it."""
    path = marker(folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    _files.write_atomic(path, _MARKER_CONTENT)


def refuse_foreign(folder: Path, action: str) -> None:
    """Raise if ``folder`` is foreign: this package never writes into, nor removes, what it did not write."""
    if is_foreign(folder):
        raise CheckpointError(
            f"cannot {action} {folder}: it holds files that accelerate-stateful did not write (no "
            f"{_files.SUBDIR}/{_files.MANIFEST} nor {_files.SUBDIR}/{MARKER}; e.g. a checkpoint of stock "
            "Accelerate or of your own code), and this package never writes into or removes such a folder; "
            "save into a new folder (with automatic naming, numbering continues after it)"
        )
