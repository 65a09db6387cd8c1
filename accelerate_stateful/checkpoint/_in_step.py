"""Every rank at the same point of its data when a checkpoint is taken or loaded.

A checkpoint is sealed as complete only if every rank's loaders describe the same point of the run.
``save_state``, ``load_state`` and ``resume`` are collective, so every rank reaches them at the same
point of its program; there each rank

1. collects garbage where a loader has an open pass (begun and not yet judged: a program-order fact, so every
   rank collects or none does), so an iterator that the program no longer reaches but that a reference cycle
   kept (an exception held in a variable, say) is let go at the same point on every rank, whatever the
   collector did before. Where no loader has one, a collection could change nothing the verdicts read, and a
   full collection costs tens of milliseconds in a large program;
2. takes the verdict of every pass let go (``loaders._lifecycle``);
3. gathers every rank's lifecycle digest (the epoch, the live pass, what was done on it and how many
   batches it handed out; not the rank's position in its own share, which may be uneven), and what defines
   each loader's data (``_compare.data_digest``: the seed, a Mixture's weights and schedule, every composable
   source's settings). The processes' exact positions are compared by the elastic merge only
   (``_compare.shared_point``): shares may be uneven (a stream per rank), and such a checkpoint resumes on the
   same number of processes; on another, the merge names what differs.

If they differ, every rank refuses, with what differs on each rank in words and the fix.
"""

from __future__ import annotations

import gc
from typing import Any, Sequence

from ._checkpoints import agree
from .._log import get_logger
from .._context import DistContext
from ._compare import data_refusal
from ..errors import LifecycleError, UnsupportedConfigError

logger = get_logger(__name__)


def settle(ctx: DistContext, loaders: Sequence[Any], call: str) -> None:
    """Collect garbage where a pass is live, take pending verdicts, and refuse on every rank unless every
    rank's loaders agree.

    Args:
        call: The collective call being made, as the user wrote it (``accelerator.save_state()``), for messages.
    """
    if any(loader._has_open_pass() for loader in loaders):  # a program-order fact: every rank collects, or none
        gc.collect()  # once for every loader: a full collection costs in proportion to the whole heap
    for index, loader in enumerate(loaders):
        if loader._has_live_pass(collected=True):  # takes the pending verdict
            _say_who_holds(ctx, index, loader, call)
    digests = agree(ctx, lambda: [(loader._digest(), loader._data_digest()) for loader in loaders])
    everyone = ctx.all_gather(digests)
    for index in range(len(loaders)):
        refusal = data_refusal([rank_digests[index][1] for rank_digests in everyone], call, index)
        if refusal is not None:
            raise UnsupportedConfigError(refusal)
        seen = [rank_digests[index][0] for rank_digests in everyone]
        if any(key != seen[0][0] for key, _ in seen[1:]):
            points = "; ".join(f"rank {rank}: {_in_words(point)}" for rank, (_, point) in enumerate(seen))
            raise LifecycleError(
                f"{call} refused: loader {index} is at different points on the processes ({points}). This "
                "happens when a process keeps an iterator over the loader that the others let go (in a global, "
                "a list, or an exception kept in a variable) or trains on other batches; let the iterator go on "
                f"every process (or keep it on every process) before {call}, so that every process's loop is at "
                "the same point"
            )


def _say_who_holds(ctx: DistContext, index: int, loader: Any, call: str) -> None:
    """A warning where a live pass is held only through a kept exception's traceback (``loaders._holders``)."""
    holder = loader._life.held_through_a_traceback()
    if holder is not None:
        logger.warning(
            "rank %d: at %s, loader %d's pass is live: its iterator is still held by %s, a frame that an "
            "exception kept in a variable or attribute holds through its traceback. The checkpoint records the "
            "pass as live, so a resumed run continues it where this run's next iter() starts the next epoch. If "
            "the loop let that iterator go, drop the exception (or its __traceback__) before %s",
            ctx.rank, call, index, holder, call,
        )


def refuse_live(ctx: DistContext, loaders: Sequence[Any], call: str) -> None:
    """Refuse a load on every rank if any rank still holds an iterator of a loader (right after :func:`settle`,
    whose collection it relies on)."""
    live = [index for index, loader in enumerate(loaders) if loader._has_live_pass(collected=True)]
    everyone = ctx.all_gather(live)
    if any(everyone):
        where = ", ".join(f"rank {rank}: loader(s) {found}" for rank, found in enumerate(everyone) if found)
        raise LifecycleError(
            f"{call} called while an iterator over a prepared loader is live ({where}); "
            "finish or drop that iterator first (a warm-up next(iter(dl)) is dropped at once; one kept in a "
            "variable is not), or load before iter()"
        )


def _in_words(point: tuple) -> str:
    epoch, taken, phase, live, waiting, *skipped = point
    words = f"epoch {epoch} after {taken} batches, {phase}"
    if live is not None:
        handed, trained = live
        words += f", an iterator live ({handed} batches from it, {'trained' if trained else 'not trained'})"
    if waiting:
        words += ", a resumed pass waiting to be continued"
    if skipped and skipped[0]:
        words += ", leaving out samples " + ", ".join(f"[{a}, {b}) of epoch {e}" for e, a, b in skipped[0])
    return words
