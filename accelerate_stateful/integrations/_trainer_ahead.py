"""``checkpoint-N`` folders past the step a Trainer run starts at: an abandoned timeline, moved aside before the
first step.

The Trainer names a save after its step. A run that starts at step S (resumed from a checkpoint at S; a fresh
start is S = 0) saves ``checkpoint-N`` of its own for N > S, so a ``checkpoint-N`` already there belongs to a run
that once went on from S: an abandoned timeline. Left in place it is met mid-run: a stock Trainer folder refuses
the save at N (this package never writes into what it did not write), and a complete one of this package is
newer than every checkpoint this run wrote so far, so ``resume_from_checkpoint=True`` after a crash would jump
back onto the abandoned timeline, and ``save_total_limit`` would keep it and rotate this run's own away.

So before the first step the main process moves every such folder, whole and byte for byte (a rename within
``output_dir``), into ``output_dir/superseded-<UTC time>/``: the Trainer's ``get_last_checkpoint``, this
package's ``resume_from_checkpoint=True`` and both rotations look only at ``output_dir``'s own ``checkpoint-N``,
so none of them reaches it there, and the time in the name keeps each set of moved folders apart and says
when. Nothing is deleted. A folder that cannot be moved refuses the run, on every rank, with every folder back
where it was. A leftover of a killed save of this package (incomplete) holds nothing to resume: it stays, and
the save at its step removes it, as it always did.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .. import _log
from .._context import DistContext
from ..checkpoint import _files
from ..checkpoint import _ownership
from ..checkpoint._checkpoints import agree
from ..errors import CheckpointError
from ._trainer_checkpoints import checkpoint_step
from ._trainer_stock import TRAINER_STATE, stock_step

logger = _log.get_logger(__name__)

SUPERSEDED = "superseded"


def start_step(checkpoint: Optional[Path]) -> int:
    """The ``global_step`` a run resumed from ``checkpoint`` (stock or this package's; ``None``: fresh) starts at."""
    if checkpoint is None:
        return 0
    try:
        step = json.loads((Path(checkpoint) / TRAINER_STATE).read_text())["global_step"]
    except (OSError, ValueError, KeyError, TypeError):
        return 0  # no trainer state: the Trainer starts at step 0 too
    return step if type(step) is int else 0


def ahead(output_dir: Path, start: int, resumed: Optional[Path]) -> list[Path]:
    """The ``checkpoint-N`` under ``output_dir`` past step ``start`` that a run starting there moves aside, lowest N
    first: every folder this package did not write (stock Trainer's) and every complete one of this package;
    never the checkpoint the run resumes (``resumed``), whatever its name."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    skip = None if resumed is None else Path(resumed).resolve()
    found = [p for p in root.iterdir() if p.is_dir() and (checkpoint_step(p) or 0) > start
             and p.resolve() != skip and (_ownership.is_foreign(p) or _files.is_complete(p))]
    return sorted(found, key=checkpoint_step)


def move_aside(ctx: DistContext, output_dir: Path, resumed: Optional[Path]) -> None:
    """Before the first step: the main process moves the folders :func:`ahead` of the run's start into a new
    ``superseded-<UTC time>`` folder of ``output_dir``, then every rank checks they are gone from ``output_dir``.
    A failure on any rank raises on every rank."""
    root = Path(output_dir)

    def plan_and_move() -> Optional[tuple[int, list[str], list[str], Optional[str]]]:
        if not ctx.is_main:
            return None
        start = start_step(resumed)
        folders = ahead(root, start, resumed)
        kinds = [_kind(p) for p in folders]  # read before the move, from the folders where they stood
        target = _move(folders, root, start) if folders else None
        return start, [p.name for p in folders], kinds, None if target is None else str(target)

    # agree() gathers from every rank once the main process is done: no rank looks before the folders moved.
    start, names, kinds, target = ctx.broadcast(agree(ctx, plan_and_move))
    agree(ctx, lambda: _refuse_left(ctx, root, start, resumed, target))
    if names and ctx.is_main:
        logger.warning(_moved_line(root, Path(target), start, resumed, names, kinds))


def _moved_line(root: Path, target: Path, start: int, resumed: Optional[Path], names: list[str],
                kinds: list[str]) -> str:
    moved = ", ".join(f"{name} ({kind})" for name, kind in zip(names, kinds))
    where = "a fresh start" if resumed is None else f"resuming {resumed}"
    return (f"moved {moved} from {root} into {target}, every file as it was: they are past step {start}, where "
            f"this run starts ({where}), so they belong to a run that once went on from there, and this run saves "
            f"its own {PREFIX_CHECKPOINT_DIR}-N at those steps; nothing was deleted. To go back to one, resume it "
            f"by its path (resume_from_checkpoint=\"{target / names[-1]}\"), or move it back into {root}")


def _kind(folder: Path) -> str:
    if stock_step(folder) is not None:
        return "stock transformers.Trainer"
    return "not written by accelerate-stateful" if _ownership.is_foreign(folder) else "accelerate-stateful"


def _move(folders: list[Path], root: Path, start: int) -> Path:
    """Rename ``folders`` into a new ``superseded-<UTC time>`` folder of ``root``: all of them, or none."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    target, suffix = root / f"{SUPERSEDED}-{stamp}", 1
    while target.exists():  # two runs started within the same second
        suffix += 1
        target = root / f"{SUPERSEDED}-{stamp}-{suffix}"
    done: list[Path] = []
    try:
        target.mkdir()
        for folder in folders:
            folder.rename(target / folder.name)
            done.append(folder)
    except OSError as exc:
        failed = folders[len(done)]
        for folder in reversed(done):
            (target / folder.name).rename(folder)
        if target.is_dir():
            target.rmdir()
        names = ", ".join(p.name for p in folders)
        raise CheckpointError(
            f"cannot start training at step {start}: {root} holds {names}, checkpoints of an earlier run past that "
            f"step, where this run saves its own, and moving {failed.name} aside into {target} failed "
            f"({exc.strerror or exc}); nothing was moved. Give this process write permission on {failed} and "
            f"{root}, or move {names} out of {root} yourself, or resume from the newest (resume_from_checkpoint=True)"
        ) from exc
    return target


def _refuse_left(ctx: DistContext, root: Path, start: int, resumed: Optional[Path], target: Optional[str]) -> None:
    """Raise if this rank still sees a folder ahead: its ``output_dir`` is not the main process's."""
    left = ahead(root, start, resumed)
    if left:
        names = ", ".join(p.name for p in left)
        main = f"moved those it sees into {target}" if target else "sees none"
        raise CheckpointError(
            f"process {ctx.rank} sees {names} in {root}, past step {start} where this run starts (the main process "
            f"{main}): output_dir is not one folder shared by every process; move {names} out of {root} on every "
            "machine that has them, then start again"
        )
