"""What a checkpoint records of a live pass: the batches the model was trained on, not the ones handed out after.

Training is attributed by program order (``training._training``). A look-ahead prefetcher (``nxt = next(it)``,
then train on the previous batch) or a save at the top of a step (after ``next()``, before the backward) has
taken batches the model was not trained on yet when ``save_state()`` runs. The uninterrupted run trains them
next, so the resumed run must hand them out again: the checkpoint records the position before them (the batches
a live pass handed out after the last training event of a loader the model trains on, ``Lifecycle.put_back``).

Where the position is a count (the shard and batch-sampler loaders, and the skip view over them) the variant
computes its state that many batches earlier (``_state_before``). A variant that cannot go back cheaply (a stream
read by workers, the dispatcher, round-robin) records where it stands, and the save says so in one warning naming
the loader and the batches it counts as trained. The counts are program-order facts, the same on every rank, and
part of the digest every rank compares at the save (``Lifecycle.digest``).
"""

from __future__ import annotations

from typing import Any, Sequence

from .._context import DistContext
from .._log import get_logger
from ._carried import entry, scoped_entry, untrained
from ._passes import PASS, Kind

logger = get_logger(__name__)


def count(life: Any, evaluation: bool = False) -> int:
    """How many batches the live pass of ``life`` (a ``Lifecycle``) handed out that the model was not trained on
    yet, on a loader the model trains on: a checkpoint does not count them as taken (a query; program-order
    facts, alike on every rank).

    A loop that trains one batch a step (each training step after the pass's first took one batch: a plain loop,
    a look-ahead prefetcher, accumulation's micro-steps) trained as many batches as it made steps; the rest (the
    look-ahead, the batch of a step saved at its top) are put back. A loop that trains on several batches a step
    trained every batch taken before its last step. With ``evaluation`` (the checkpoint holds a loader the model
    trains on), a pass of a loader the model was never trained on (an evaluation saved inside its loop, a peek) is
    put back whole: the uninterrupted run undoes it where the loop lets it go, so the resumed run's next pass
    begins where it began. Without, nothing tells it from a loop whose training is not seen: it goes on. None for
    a re-run pass.
    """
    live = life.live
    record = live if live is not None else life.owed
    if record is not None and record.off_thread:  # a prefetcher thread's: what it took beyond what was trained
        return untrained(life, record)
    if live is None:
        owed = life.owed
        return 0 if owed is None or not (life.trains or owed.trained) else untrained(life, owed)
    if live.kind is Kind.REPLAY:
        return 0
    if not (life.trains or live.trained):
        return live.handed if evaluation else 0
    return untrained(life, live)



def is_a_guess(life: Any) -> bool:
    """Whether :func:`count` read a first step that took several batches as a look-ahead, with nothing to tell it
    from a step trained on all of them (no later step of this pass, no earlier pass)."""
    record = life.live if life.live is not None else life.owed
    return (count(life) > 0 and record.steps == 1 and record.trained_at > 1 and not record.several
            and life.one_a_step is None)


def checkpoint_state(loader: Any, inside: bool = False, trains: bool = False) -> tuple[dict, int, int]:
    """``(state a checkpoint records, batches put back, batches it counts as trained although they were not)``.

    A pure read, like ``state_dict()``: the loader's position does not move. ``inside``: a loader the checkpoint
    holds has a live pass the model trains on (``_carried.scoped_entry``); ``trains``: the checkpoint holds a
    loader the model trains on (:func:`count`'s ``evaluation``).
    """
    with loader._life.lock:  # a prefetcher thread moves the position and its count together
        return _checkpoint_state(loader, inside, trains)


def _checkpoint_state(loader: Any, inside: bool, trains: bool) -> tuple[dict, int, int]:
    life = loader._life
    count = life.put_back(evaluation=trains)
    if count == 0:
        state = loader.state_dict()
        scoped = scoped_entry(life) if inside else None
        if scoped is not None:
            state[PASS] = scoped
        return state, 0, 0
    record = life.live if life.live is not None else life.owed
    mark = record.at_end if record.complete or record.closed else loader._position_mark()
    state = None if mark is None else loader._state_before(mark, count)
    if state is None:
        return loader.state_dict(), 0, count
    state[PASS] = entry(life, put_back=True)
    return state, count, 0


def checkpoint_states(ctx: DistContext, loaders: Sequence[Any], call: str) -> list[dict]:
    """Every loader's :func:`checkpoint_state`, with one warning for each loader whose put-back is not certain:
    it could not go back, or it read a first step that took several batches as a look-ahead."""
    states = []
    inside = any(loader._life.live is not None and (loader._life.trains or loader._life.live.trained)
                 for loader in loaders)
    trains = any(loader._life.trains or (loader._life.live is not None and loader._life.live.trained)
                 for loader in loaders)  # the checkpoint holds a loader the model trains on
    for index, loader in enumerate(loaders):
        state, put_back, kept = checkpoint_state(loader, inside, trains)
        name = f"loader {index} (the {loader.mode} loader over {type(loader.dataset).__name__})"
        life = loader._life
        if kept and ctx.is_main and not (life.trains or life.live is None or life.live.trained):
            logger.warning(
                "at %s, %s was inside a pass the model is not trained on (an evaluation saved inside its loop) "
                "after %d batch(es); this loader cannot go back to where that pass began, so the resumed run's next "
                "pass over it continues from there. Save outside the evaluation loop",
                call, name, kept,
            )
        elif kept and ctx.is_main:  # the same on every rank (program order): said once
            logger.warning(
                "at %s, %s had handed out %d batch(es) the model was not trained on yet (taken after the last "
                "training step, or fetched ahead); this loader cannot put them back, so the checkpoint counts them "
                "as trained and a resumed run will not see them. Save at the end of the step, after the backward "
                "pass and the optimizer step, and before fetching the next batch",
                call, name, kept,
            )
        elif put_back and _thread_without_backward(life) and ctx.is_main:
            logger.warning(
                "at %s, %s was read by a thread other than the one that prepared it (a prefetcher thread) and the "
                "model was trained with no accelerator.backward() call: the checkpoint counts a thread's batches as "
                "trained one per accelerator.backward(), so it puts back all %d batch(es) and a resumed run trains "
                "them again. Call accelerator.backward(loss) instead of loss.backward()",
                call, name, put_back,
            )
        elif put_back and is_a_guess(loader._life) and ctx.is_main:
            logger.warning(
                "at %s, %s had handed out %d batches before its pass's first training step; the checkpoint counts "
                "%d of them as fetched ahead and not trained (a look-ahead prefetcher), so a resumed run hands them "
                "out again. If that step trained on all of them (several batches a step), save after the next step "
                "instead: from its second step on, a pass tells the two apart",
                call, name, (life.live or life.owed).trained_at, put_back,
            )
        states.append(state)
    return states


def _thread_without_backward(life: Any) -> bool:
    """Whether a prefetcher thread's pass was trained with no ``accelerator.backward()`` (a program-order fact)."""
    record = life.live if life.live is not None else life.owed
    return record is not None and record.off_thread and record.trained and record.backwards == 0
