"""``checkpoint-N`` folders of a Trainer run: which are complete, the newest one, the clean-up before a save and
rotation after it.

A ``checkpoint-N`` is complete when its manifest (``accelerate_stateful/MANIFEST.json``, written last, after
every rank's files) is valid and every file it lists has its recorded size. The clean-up and the rotation change
files on one process, inside ``_checkpoints.agree``: an error there raises, with its cause, on every rank.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Optional, Union

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .. import _log
from .._context import DistContext
from ..checkpoint import _checkpoints
from ..checkpoint import _files
from ..checkpoint import _ownership

logger = _log.get_logger(__name__)

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


def clear_leftover(ctx: DistContext, folder: Path) -> None:
    """Make ``folder`` ready for a save of its step on every rank: refused if this package did not write it;
    removed if a killed save left it incomplete; a complete checkpoint is kept and unsealed (its files are then
    replaced in place), so it counts as incomplete from the first byte the new save changes."""
    _checkpoints.agree(ctx, lambda: _ownership.refuse_foreign(folder, "save into"))

    def remove_unfinished() -> None:
        if ctx.is_main and folder.exists() and not _files.is_complete(folder):
            logger.warning("removing the unfinished checkpoint %s before saving this step there", folder)
            shutil.rmtree(folder)

    _checkpoints.agree(ctx, remove_unfinished)
    _checkpoints.mark(ctx, folder)


def rotate_after_save(ctx: DistContext, run_dir: Path, keep: Optional[int], best: Optional[str],
                      rotates: bool) -> None:
    """:func:`rotate` on the process that ``rotates`` (the main process, where it saves), once the new checkpoint
    is sealed; an error there raises on every rank."""
    _checkpoints.agree(ctx, lambda: rotate(run_dir, keep, best) if rotates else None)
