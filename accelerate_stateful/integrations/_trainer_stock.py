"""``checkpoint-N`` folders of stock ``transformers.Trainer``: found, described, and never touched.

A project that switches to ``StatefulTrainer`` keeps its stock checkpoints. One is complete when its
``trainer_state.json`` (which the Trainer writes last) parses with a ``global_step``. ``StatefulTrainer``
resumes it as the stock Trainer does (model, optimizer, scheduler, RNG, ``global_step``, and the batches
trained in the epoch skipped), the skip made by moving the loader's position rather than reading; every
checkpoint it writes from then on is its own. The stock folder is never removed, rotated or written into.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .. import _log
from .._context import DistContext
from ..checkpoint import _ownership
from ..checkpoint._checkpoints import agree
from ..checkpoint._stock import order_note
from ..errors import CheckpointError
from ._trainer_checkpoints import checkpoint_step

logger = _log.get_logger(__name__)

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


def start_step(checkpoint: Optional[Path]) -> int:
    """The ``global_step`` a run resumed from ``checkpoint`` (stock or this package's; ``None``: fresh) starts at."""
    if checkpoint is None:
        return 0
    try:
        step = json.loads((Path(checkpoint) / TRAINER_STATE).read_text())["global_step"]
    except (OSError, ValueError, KeyError, TypeError):
        return 0  # no trainer state: the Trainer starts at step 0 too
    return step if type(step) is int else 0


def refuse_stock_ahead(ctx: DistContext, output_dir: Path, checkpoint: Optional[Path]) -> None:
    """Raise on every rank, before the first step, if a stock ``checkpoint-N`` lies past the step this run starts
    at: the Trainer names a save after its step, so this run would reach N and find that folder taken."""
    def check() -> None:
        if not ctx.is_main:
            return
        start = start_step(checkpoint)
        root = Path(output_dir)
        ahead = sorted((p for p in root.iterdir() if p.is_dir() and (checkpoint_step(p) or 0) > start
                        and stock_step(p) is not None), key=checkpoint_step) if root.is_dir() else []
        if ahead:
            names = ", ".join(p.name for p in ahead)
            where = f"from {checkpoint}" if checkpoint is not None else "from step 0"
            raise CheckpointError(
                f"cannot train {where}: {root} holds {names} of stock transformers.Trainer, past step {start}; "
                f"this run would save {PREFIX_CHECKPOINT_DIR}-{checkpoint_step(ahead[0])} into a folder it never "
                f"writes into. Resume from the newest ({ahead[-1]}: resume_from_checkpoint=True), or move "
                f"{names} out of {root} first"
            )

    agree(ctx, check)


def resume_line(folder: Path, epoch: int, batches: int, loader: Any) -> str:
    """What a resume from a stock Trainer checkpoint restores, and what happens from there."""
    return (f"resuming {folder}, a checkpoint of stock transformers.Trainer (global_step {stock_step(folder)}; left "
            f"as it is): the Trainer restores the model, optimizer, scheduler, RNG and its state as stock Trainer "
            f"does, and its data skip (epoch {epoch}, {batches} batches) moves the loader's position, reading "
            f"nothing{order_note(loader)}; the {PREFIX_CHECKPOINT_DIR}-N saved from now on are this package's and "
            "resume exactly")
