"""Checkpoints of stock ``accelerate.Accelerator``: found, checked, and their loader positions translated.

A project that switches over has ``checkpoint_<N>`` folders written by stock Accelerate (foreign, see
``_ownership``). ``resume()`` continues from the newest of them when it is newer than every complete
checkpoint of this package: Accelerate's own ``load_state`` restores the model, optimizer, scheduler,
scaler, random states and ``accelerator.step``; the loader position comes from the stock loader state
where the stock run saved one (``use_stateful_dataloader=True`` writes ``dl_state_dict.bin``, then
``dl_state_dict_<i>.bin``: torchdata ``StatefulDataLoader`` states, taken as the batch was handed out).

What is translated is exact: the number of batches of the epoch this rank took, which for a map-style
loader is the samples the epoch consumed. What a stock checkpoint does not record is said in the resume
line: the epoch's number, and a shuffle's order (stock Accelerate draws it afresh, and so did its own
resume); a stream's position is opaque to this package, so a stream starts its epoch at its beginning.

A stock folder is complete for this process when it holds ``random_states_<rank>.pkl``, the file Accelerate
writes last; it is never written into nor removed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from accelerate.utils import RNG_STATE_NAME
from accelerate.utils import load as accelerate_load

from .. import _log
from . import _files
from . import _ownership
from . import _resume
from ._checkpoints import agree, same_everywhere
from .._context import DistContext
from ..errors import CheckpointError

logger = _log.get_logger(__name__)

_RNG_FILE = re.compile(rf"^{RNG_STATE_NAME}_(\d+)\.pkl$")
SKIP_RECIPE = "accelerator.skip_first_batches(train_dl, n)"
TRANSLATED = ("shard", "batch-sampler")  # map-style loaders positioned per rank, as stock Accelerate's shards


@dataclass(frozen=True)
class StockPosition:
    """Where a stock loader stood: batches of the epoch this rank took, and whether that was all of them."""

    batches: int
    finished: bool


def loader_file(index: int) -> str:
    return "dl_state_dict.bin" if index == 0 else f"dl_state_dict_{index}.bin"


def is_stock(folder: Path, rank: int) -> bool:
    """Whether ``folder`` is a foreign checkpoint that stock Accelerate completed for process ``rank``."""
    return _ownership.is_foreign(folder) and (Path(folder) / f"{RNG_STATE_NAME}_{rank}.pkl").is_file()


def newest(ctx: DistContext, root: Path) -> Optional[Path]:
    """The newest ``checkpoint_<N>`` under ``root`` that is a stock checkpoint complete on every rank, or ``None``."""
    def mine() -> list[int]:
        return [_files.checkpoint_number(p) for p in _files.numbered_checkpoints(root) if is_stock(p, ctx.rank)]

    everyone = ctx.all_gather(agree(ctx, mine))
    common = sorted(set(everyone[0]).intersection(*everyone[1:]), reverse=True)
    found = Path(root) / f"checkpoint_{common[0]}" if common else None
    if ctx.is_main:
        for path in _ownership.foreign_among(_files.numbered_checkpoints(root)):
            if found is None or _files.checkpoint_number(path) > _files.checkpoint_number(found):
                logger.warning("skipping %s: this package did not write it, and it is not a checkpoint that "
                               "stock Accelerate completed on every process (no %s_<rank>.pkl); it is left as it "
                               "is", path, RNG_STATE_NAME)
    return found


def resume_line(folder: Path, restored: str, step: int, said: Sequence[str], unnumbered: Sequence[int],
                next_number: int) -> str:
    """The one line that says what a resume from a stock checkpoint restored, and from where.

    ``restored`` names what Accelerate's ``load_state`` loaded (:func:`restored_parts`); ``unnumbered`` are the
    loaders whose epoch the script did not set before ``resume()``: only they get the advice to.
    """
    loaders = "; ".join(said) if said else "no stateful loader prepared"
    epoch = ""
    if unnumbered:
        which = ", ".join(f"loader {i}" for i in unnumbered)
        epoch = (f" (a stock checkpoint records no epoch: {which} counted it from 0 in this process; if your script "
                 "numbers epochs, call train_dl.set_epoch(e) before resume(): a set_epoch() of another epoch after "
                 "it starts that epoch at its first batch)")
    return (f"resumed from {folder}, a checkpoint of stock Accelerate (left as it is): {restored} and step ({step}) "
            f"through Accelerate's load_state; {loaders}{epoch}; the next save is checkpoint_{next_number}")


def restored_parts(accelerator: Any) -> str:
    """What Accelerate's ``load_state`` restores for ``accelerator``: the objects it prepared, and random states."""
    counts = [("model", len(accelerator._models)), ("optimizer", len(accelerator._optimizers)),
              ("scheduler", len(accelerator._schedulers)), ("registered object", len(accelerator._custom_objects))]
    parts = [name if n == 1 else f"{n} {name}s" for name, n in counts if n]
    if accelerator.scaler is not None:
        parts.append("gradient scaler")
    return ", ".join(parts + ["random states"])


def unnumbered(loaders: Sequence[Any]) -> list[int]:
    """The loaders whose epoch the script has not set (``set_epoch``) in this process."""
    return [index for index, loader in enumerate(loaders) if not loader._epoch_set]


def agreed_is_stock(ctx: DistContext, folder: Any) -> bool:
    """Whether ``folder`` (``load_state``'s ``input_dir``, maybe ``None``) is a stock checkpoint, agreed by every rank."""
    mine = agree(ctx, lambda: folder is not None and is_stock(Path(folder), ctx.rank))
    return same_everywhere(ctx, mine, f"whether {folder} is a checkpoint of stock Accelerate")


def newest_to_resume(ctx: DistContext, root: Path) -> Optional[tuple[Path, Optional[dict]]]:
    """The newest checkpoint to resume under ``root``, with its manifest: this package's complete on every
    rank, or a newer one of stock Accelerate (manifest ``None``); ``None`` when there is neither."""
    ours = _resume.agreed_latest(ctx, root)
    stock = newest(ctx, root)
    if stock is not None and (ours is None or _files.checkpoint_number(stock) > _files.checkpoint_number(ours[0])):
        return stock, None
    return ours


def saved_world_size(folder: Path) -> int:
    """How many processes wrote ``folder``: its ``random_states_<rank>.pkl`` files."""
    ranks = {int(m.group(1)) for m in map(_RNG_FILE.match, (p.name for p in Path(folder).iterdir())) if m}
    return len(ranks)


def check(ctx: DistContext, folder: Path, loaders: Sequence[Any]) -> list[Optional[StockPosition]]:
    """This rank's stock loader positions, once the folder is known to load as the stock run wrote it.

    Raises on every rank: another number of processes (the random states are per process), a random-state
    file Accelerate would skip, loader states that do not match the loaders prepared, or ranks that stood at
    different batches.
    """
    num_loaders = len(loaders)

    def read() -> list[Optional[StockPosition]]:
        saved = saved_world_size(folder)
        if saved != ctx.world_size:
            raise CheckpointError(
                f"{folder} was saved by stock Accelerate on {saved} processes; resume it on {saved} processes "
                "(its random states are per process), then save: checkpoints of accelerate-stateful resume on "
                "any number"
            )
        _resume.read_rng_file(folder / f"{RNG_STATE_NAME}_{ctx.rank}.pkl")
        found = sorted(p.name for p in Path(folder).glob("dl_state_dict*.bin"))
        if found and found != sorted(loader_file(i) for i in range(num_loaders)):
            raise CheckpointError(
                f"{folder} holds the loader states {found} of stock Accelerate, this run prepared {num_loaders} "
                "stateful loaders; prepare the same loaders in the same order as the stock run"
            )
        positions = [_position(folder / loader_file(i)) for i in range(num_loaders)] if found else [None] * num_loaders
        for position, loader in zip(positions, loaders):
            if position is not None and loader.mode in TRANSLATED and position.batches > len(loader):
                raise CheckpointError(
                    f"the stock run had taken {position.batches} batches of its epoch when it saved {folder}, "
                    f"this process's loader has {len(loader)}; prepare it with the stock run's dataset and batch size"
                )
        return positions

    positions = agree(ctx, read)
    compared = [p for p, loader in zip(positions, loaders) if loader.mode in TRANSLATED]
    everyone = ctx.all_gather(compared)
    if any(other != compared for other in everyone):
        seen = "; ".join(f"rank {rank}: {p}" for rank, p in enumerate(everyone))
        raise CheckpointError(
            f"the processes of the stock run stood at different batches when {folder} was saved ({seen}); no "
            "single position continues every process exactly: resume from an earlier checkpoint"
        )
    return positions


def _position(path: Path) -> StockPosition:
    """The batches a torchdata ``StatefulDataLoader`` state had handed out (main process or workers)."""
    try:
        state = accelerate_load(path)
        snapshot = state.get("_snapshot")
        if snapshot is not None:  # num_workers > 0: the last snapshot, and the steps taken since
            batches = snapshot["_snapshot_step"] + state.get("_steps_since_snapshot", 0)
        else:
            batches = state["_num_yielded"]
        finished = bool(state.get("_iterator_finished", False))
        if type(batches) is not int or batches < 0:
            raise ValueError(f"a batch count of {batches!r}")
    except Exception as exc:  # an unreadable or unknown state: refused with the file named
        raise CheckpointError(
            f"{path} is not a loader state of stock Accelerate this release reads ({type(exc).__name__}: {exc}); "
            "resume from another checkpoint"
        ) from None
    return StockPosition(batches, finished)


def place(loaders: Sequence[Any], positions: Sequence[Optional[StockPosition]]) -> list[str]:
    """Move each loader to its translated position in the epoch it stands in; returns a phrase per loader."""
    said = []
    for index, (loader, position) in enumerate(zip(loaders, positions)):
        loader._anchor()
        epoch = loader.epoch
        if position is None:
            said.append(f"loader {index}: no loader state in it (the stock run had use_stateful_dataloader=False): "
                        f"epoch {epoch} starts at its first batch; position it as your stock script did, with "
                        f"{SKIP_RECIPE}")
        elif loader.mode not in TRANSLATED:
            said.append(f"loader {index}: the stock position of a {loader.mode} loader cannot be translated: "
                        f"epoch {epoch} starts at its first batch ({position.batches} batches had been taken)")
        elif position.finished:
            loader.set_epoch(epoch + 1)
            said.append(f"loader {index}: the stock run had finished its epoch: epoch {epoch + 1} starts")
        else:
            loader.seek(position.batches)
            said.append(f"loader {index}: epoch {epoch} at batch {position.batches} of {len(loader)} "
                        f"(stock {loader_file(index)}){order_note(loader)}")
    return said


def order_note(loader: Any) -> str:
    """Nothing for an order the stock run drew as this package does (sequential, or ``use_seedable_sampler``'s
    shuffle, a function of seed and epoch); else that the stock shuffle is not recorded."""
    if loader._config().get("order") in ("sequential", "seedable-random"):
        return ""
    return ("; the rest of the epoch follows this package's order, drawn from the loader's seed: the stock run "
            "drew a shuffle that its checkpoint does not record")
