"""``checkpoint-N`` folders of stock ``transformers.Trainer``: found, described, and never written into.

A project that switches to ``StatefulTrainer`` keeps its stock checkpoints. One is complete when its
``trainer_state.json`` (which the Trainer writes last) parses with a ``global_step``. ``StatefulTrainer``
resumes it as the stock Trainer does (model, optimizer, scheduler, RNG, ``global_step``, and the batches
trained in the epoch skipped), the skip made by moving the loader's position rather than reading; every
checkpoint it writes from then on is its own. The stock folder is never removed, rotated or written into; one
past the step a run starts at is moved aside, whole, before the first step (``_trainer_ahead``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..checkpoint import _ownership
from ..checkpoint._stock import order_note
from ._trainer_checkpoints import checkpoint_step

TRAINER_STATE = "trainer_state.json"


def stock_step(folder: Path) -> Optional[int]:
    """The ``global_step`` of a complete stock Trainer checkpoint at ``folder``; ``None`` for anything else."""
    folder = Path(folder)
    if not _ownership.is_foreign(folder):
        return None
    try:
        step = json.loads((folder / TRAINER_STATE).read_text())["global_step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if type(step) is int else None


def newest_stock(output_dir: Path) -> Optional[Path]:
    """The newest (highest N) complete stock ``checkpoint-N`` under ``output_dir``, or ``None``."""
    root = Path(output_dir)
    if not root.is_dir():
        return None
    found = [p for p in root.iterdir() if p.is_dir() and checkpoint_step(p) is not None and stock_step(p) is not None]
    return max(found, key=checkpoint_step, default=None)


def newer(stock: Optional[Path], ours: Optional[Path]) -> bool:
    """Whether the stock checkpoint ``stock`` is the one to resume rather than this package's ``ours``."""
    return stock is not None and (ours is None or checkpoint_step(stock) > checkpoint_step(ours))


def resume_line(folder: Path, epoch: int, batches: int, loader: Any) -> str:
    """What a resume from a stock Trainer checkpoint restores, and what happens from there."""
    return (f"resuming {folder}, a checkpoint of stock transformers.Trainer (global_step {stock_step(folder)}; left "
            f"as it is): the Trainer restores the model, optimizer, scheduler, RNG and its state as stock Trainer "
            f"does, and its data skip (epoch {epoch}, {batches} batches) moves the loader's position, reading "
            f"nothing{order_note(loader)}; the {PREFIX_CHECKPOINT_DIR}-N saved from now on are this package's and "
            "resume exactly")
