"""``checkpoint-N`` folders of a Trainer run: which are complete, the newest one, and rotation after a save.

A ``checkpoint-N`` is complete when its manifest (``accelerate_stateful/MANIFEST.json``, written last, after
every rank's files) is valid and every file it lists has its recorded size.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Optional, Union

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..checkpoint import _files
from ..checkpoint import _ownership

_CHECKPOINT_NAME = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def checkpoint_step(path: Union[str, Path]) -> Optional[int]:
    """N of a ``checkpoint-N`` folder, or ``None`` for another name."""
    match = _CHECKPOINT_NAME.match(Path(path).name)
    return int(match.group(1)) if match else None


def complete_trainer_checkpoints(output_dir: Union[str, Path]) -> list[Path]:
    """The complete ``checkpoint-N`` folders under ``output_dir``, newest (highest N) first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and checkpoint_step(p) is not None]
    return [p for p in sorted(found, key=checkpoint_step, reverse=True) if _files.is_complete(p)]


def latest_trainer_checkpoint(output_dir: Union[str, Path]) -> Optional[Path]:
    """The newest complete ``checkpoint-N`` under ``output_dir``; a folder whose save was cut short never counts."""
    return next(iter(complete_trainer_checkpoints(output_dir)), None)


def rotate(run_dir: Path, keep: Optional[int], best: Optional[str]) -> None:
    """Keep the ``keep`` newest complete checkpoints (and the best one); drop older ones and older leftovers,
    all of them this package's: a folder it did not write (a stock Trainer checkpoint) is never removed."""
    if keep is None or keep <= 0:
        return
    complete = complete_trainer_checkpoints(run_dir)
    kept = set(complete[:keep]) | ({Path(best)} if best else set())
    if not complete:
        return
    oldest_kept = min(checkpoint_step(p) for p in complete[:keep])
    for path in run_dir.iterdir():
        step = checkpoint_step(path)
        if path.is_dir() and step is not None and step < oldest_kept and path not in kept and _ownership.is_ours(path):
            shutil.rmtree(path)
