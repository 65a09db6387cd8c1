"""Saved loader states waiting for their loader: a loader prepared after ``load_state``/``resume()``.

Scripts often prepare the evaluation loader after resuming. A checkpoint that holds more loader states
than this run has prepared then loads the first ones into the prepared loaders, and the rest wait here,
in preparation order: the k-th loader prepared gets the k-th saved state, when ``prepare`` builds it,
with the checks a load makes (kind, dataset size, settings, seed) and under ``agree``, so every rank
takes it or every rank refuses, with a message naming the saved loader and the prepared one.

A save taken before they are prepared writes them again, unchanged, so no saved position is lost; the
first such save says once which loaders wait (a loader the script no longer prepares is carried along
the same way). A state saved on another number of processes is dealt to this run's processes by its
loader (``merge_rank_states``), so it cannot be carried before that loader exists: such a save is
refused on every rank with the fix (prepare the loader first).

Every rank holds the same list by construction (it comes from the manifest every rank agreed on), so
the collectives of ``give`` and ``carried`` run on every rank or on none.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from .. import _log
from . import _files
from . import _refusals
from ._checkpoints import agree, same_everywhere
from ._resume import read_rank_state, shared_state
from .._context import DistContext
from ..errors import CheckpointError, StatefulLoaderError

logger = _log.get_logger(__name__)


@dataclass(frozen=True)
class Waiting:
    """A saved loader state whose loader is not prepared yet.

    Attributes:
        index: The loader's index in the checkpoint (its place in preparation order).
        own: This rank's saved state; ``None`` when the checkpoint was saved on another number of processes.
        every: On the main process, every saved rank's state (a merge needs them); elsewhere ``None``.
        described: The loader that saved it, in words (from the main process's reading, the same on every rank).
    """

    checkpoint: Path
    saved_world: int
    index: int
    own: Any
    every: Optional[list]
    described: str = ""


def read(ctx: DistContext, checkpoint: Path, manifest: dict, prepared: int) -> list[Waiting]:
    """The states of ``checkpoint`` past the ``prepared`` loaders, read and checked (kept by ``Pending.keep``
    once the load succeeded), on every rank alike. Each rank reads its own; the main process every saved rank's
    (the loader, once prepared, may need them all: ``merge_rank_states``).

    Raises on every rank where the processes prepared different numbers of loaders before the load: the
    loaders prepared later would take their states on some processes only.
    """
    same_everywhere(ctx, prepared, "the number of loaders prepared before load_state()/resume()")
    world = manifest["world_size"]

    def read_all() -> list[Waiting]:
        found = []
        for index in range(prepared, manifest["num_loaders"]):
            own = read_rank_state(checkpoint, manifest, index, ctx.rank) if world == ctx.world_size else None
            every = None
            if ctx.is_main:
                every = [own if r == ctx.rank and own is not None else read_rank_state(checkpoint, manifest, index, r)
                         for r in range(world)]
            found.append(Waiting(Path(checkpoint), world, index, own, every))
        return found

    found = agree(ctx, read_all)
    described = ctx.broadcast([_refusals.describe_saved(w.every[0]) for w in found] if ctx.is_main else None)
    return [replace(w, described=words) for w, words in zip(found, described)]


class Pending:
    """The saved states of the loaders this run has not prepared yet, first to be prepared first."""

    def __init__(self) -> None:
        self._waiting: list[Waiting] = []
        self._said = False

    def keep(self, waiting: list[Waiting]) -> None:
        """Replace what waits by the states a load just read (a load replaces every position)."""
        self._waiting, self._said = list(waiting), False

    def give(self, ctx: DistContext, loader: Any, index: int) -> Optional[tuple[dict, Path]]:
        """Load the state saved for the loader prepared at ``index``, if one waits: returns it and its
        checkpoint. Refused on every rank, naming the saved loader and this one, if it does not fit."""
        if not self._waiting:
            return None
        waiting = self._waiting[0]
        first = waiting.own if waiting.every is None else waiting.every[0]
        merged = agree(ctx, lambda: shared_state(loader, waiting.own, first, lambda: waiting.every)
                       if ctx.is_main else None)
        shared = ctx.broadcast(merged)
        state = shared if shared is not None else waiting.own
        sizes = ctx.all_gather(loader._config().get("batch_size"))
        source = str(_files.state_file(waiting.checkpoint, waiting.index, ctx.rank))

        def load() -> None:
            try:
                _refusals.uneven_batch_sizes(sizes, loader, state, source)
                loader.validate_state(state, source=source)
            except StatefulLoaderError as exc:
                raise _naming_both(exc, waiting, loader, index) from None
            loader.load_state_dict(state)

        agree(ctx, load)
        self._waiting.pop(0)
        return state, waiting.checkpoint

    def carried(self, ctx: DistContext) -> list[Any]:
        """This rank's states of the loaders still waiting, for a save to write again after the prepared ones;
        said once on the main process. Refused, before the save writes anything, where they cannot be carried."""
        elsewhere = [w for w in self._waiting if w.saved_world != ctx.world_size]
        if elsewhere:
            first = elsewhere[0]
            raise CheckpointError(
                f"save_state() cannot keep the saved position of loader {first.index} ({first.described}): it was "
                f"saved in {first.checkpoint} on {first.saved_world} processes and this run has not prepared it yet, "
                f"so its position is not yet dealt to this run's {ctx.world_size} processes; prepare it "
                "(accelerator.prepare(...)) before the first save_state()"
            )
        if self._waiting and not self._said and ctx.is_main:
            names = "; ".join(f"loader {w.index}: {w.described}" for w in self._waiting)
            logger.warning(
                "save_state() also keeps the saved positions of the loaders this run has not prepared yet (%s), as "
                "%s saved them: each takes its position when it is prepared, in the order of the run that saved them",
                names, self._waiting[0].checkpoint,
            )
        self._said = True
        return [w.own for w in self._waiting]


def _naming_both(exc: StatefulLoaderError, waiting: Waiting, loader: Any, index: int) -> StatefulLoaderError:
    """``exc``, of its class and attributes, prefixed with the loader that saved the state and the one
    prepared to take it."""
    message = (
        f"the loader prepared as loader {index}, after load_state()/resume(), does not fit the state "
        f"{waiting.checkpoint} saved for loader {waiting.index}: that state was saved by {waiting.described}, "
        f"this run prepared {_refusals.describe(loader)}. {exc}\n(the k-th loader prepared takes the k-th saved "
        "state, before or after resuming: if the loaders were prepared in another order, prepare them in the order "
        "of the run that saved it)"
    )
    error = type(exc).__new__(type(exc))
    BaseException.__init__(error, message)
    error.__dict__.update(vars(exc))
    return error
