"""The lines a run prints about where its data stands: a resume, a fresh start, data no checkpoint holds.

Each is a warning on the main process (``_log.main_process_logger``): it shows by default, once per run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import _log

logger = _log.main_process_logger(__name__)


def fresh_start_line(root: Path, setting: str) -> str:
    """What a resume that finds nothing says: the folder it looked in, so that a mistyped one shows."""
    root = Path(root)
    where = root if root.is_absolute() else f"{root} (in {Path.cwd()})"
    missing = "" if root.is_dir() else ", a folder that does not exist"
    return (f"no complete checkpoint under {where}{missing}: starting a fresh run; if this run should continue "
            f"another, check that {setting} names the folder that run saved into")


def untracked_training_line(output_dir: Path) -> str:
    """The model was trained on batches no prepared loader handed out: their position is in no checkpoint.

    Known from the training events (``training/_training.py``): one that comes while no prepared loader's pass
    is current. A plain DataLoader iterated beside a prepared loader's pass is not seen (docs/lifecycle.md).
    """
    return (f"the model was trained on batches that no loader prepared by accelerator.prepare() handed out (a "
            f"DataLoader never passed to prepare(), or the original of one that was): {output_dir} does not hold "
            "their position, so a resume reads that data again from its beginning; pass the DataLoader to "
            "accelerator.prepare() and iterate the loader it returns")


def log_resume(index: int, loader: Any, state: dict, source: Path) -> None:
    """One line saying where the loader resumes, and the change of topology it handles."""
    epoch, taken, between = loader._resume_point()
    done = 1.0 if between else loader.progress()
    progress = f"batch {taken}" if done is None else f"{100 * done:.1f}%"
    now = f"{loader.ctx.world_size} ranks x {loader.num_workers} workers"
    saved = state["topology"]
    was = f"{saved.get('world_size')} x {saved.get('num_workers')}"
    changes = "" if was == f"{loader.ctx.world_size} x {loader.num_workers}" else f" (was {was})"
    batch = loader._batch_change(state)
    if batch is not None:
        changes += f" with batch_size={batch[1]} (was {batch[0]})"
    skipped = ", ".join(f"[{start}, {stop}) of epoch {e}" for e, start, stop in loader.skipped_samples if e >= epoch)
    if skipped:
        changes += f", leaving out samples {skipped},"
    if not changes:
        logger.warning("loader %d: resuming epoch %d at %s on %s (%s)", index, epoch, progress, now, source)
    else:
        logger.warning(
            "loader %d: resuming epoch %d at %s on %s%s from %s", index, epoch, progress, now, changes, source
        )
