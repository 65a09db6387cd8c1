"""What a checkpoint carries of a loader's passes, and what a resume makes of it (``docs/lifecycle.md``).

The ``"pass"`` entry of a loader state records the pass a resume continues: the live one (where it began,
whether it was trained, the untrained passes the program made before it), a pass that ended before the loop
trained its last batches (``Lifecycle.owed``), or one that ended inside the loops around another loader's live
pass (:func:`scoped_entry`). :func:`restore` turns it back into the :class:`Continuation` the loader's next passes
go on from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional

from ..training import _training
from ._passes import PASS, Kind, PassOrigin, Phase, check_entry

if TYPE_CHECKING:
    from ._lifecycle import Lifecycle


@dataclass(frozen=True)
class Continuation:
    """A pass that was live when the restored state was saved, waiting to be continued.

    ``complete``: it had handed out its epoch's last batch (``taken`` of them); the loader stands at the
    start of the next epoch, and the pass's continuation is the empty rest of its epoch.
    """

    origin: PassOrigin
    trained: bool
    peeks: int
    saved: Mapping[str, Any]  # the position restored (this rank's, this topology's): a re-run is undone to it
    complete: bool = False
    taken: Optional[int] = 0  # None: saved on another topology, counted in other batches
    scoped: bool = False  # a pass that ended inside another loader's live pass (:func:`scoped_entry`)
    window: int = 0  # ``_training.events()`` when it was restored: a scoped rest is re-entered until it moves


def entry(life: "Lifecycle", put_back: bool = False) -> Optional[dict]:
    """The ``"pass"`` entry of ``state_dict()``: the live (or waiting) pass a resume continues.

    Args:
        put_back: The state is ``Lifecycle.put_back``'s batches earlier: a pass complete at its last batch is not
            complete there.
    """
    live, trains = life.live, life.trains or (life.live is not None and life.live.trained)
    if live is not None and live.kind is not Kind.REPLAY:
        complete = live.complete and not put_back
        return _entry(live.origin, live.trained, live.peeks, complete, live.final[1], trains)
    owed = life.owed if live is None and (trains or (life.owed is not None and life.owed.trained)) else None
    if owed is not None and put_back:  # the loop goes on training the ended pass's last batches
        return _entry(owed.origin, owed.trained, owed.peeks, False, 0, trains)
    if owed is not None and untrained(life, owed) == 0:  # it trained them: inside the loop, at its end
        return _entry(owed.origin, owed.trained, owed.peeks, True, owed.final[1], trains)
    if life.pending is not None and not life.pending.scoped:
        p = life.pending
        return _entry(p.origin, p.trained, p.peeks, p.complete, life._finished_count() if p.complete else 0,
                      trains)
    return None

def scoped_entry(life: "Lifecycle") -> Optional[dict]:
    """At a checkpoint taken while another loader's pass the model trains on is live: the ``"pass"`` entry of
    this loader if its last pass, trained, ended and none began since, else ``None``.

    Trained means its last step was its own (``_training``): an evaluation let go at an epoch's end that the
    next epoch's first step marks trained is not one. The loops around that live pass made this pass and saw
    it end (the shorter loader of a
    ``zip_longest``, a task of a round-robin waiting for the others, ``chain(islice(b, 2), a)``'s ``b``).
    The resumed program runs those loops again from their top: until it goes past where it was (it trains,
    or a pass hands out a batch or ends, re-run peeks aside), this loader's next pass is its ended epoch's
    rest, which is empty, and ``set_epoch`` with that epoch changes nothing; as in the uninterrupted run,
    its pass after that reads the next epoch. A loader whose pass ended in an earlier round of those loops
    is only made again after the program went past that point, so it reads its next epoch.
    """
    if life.live is not None:
        return None
    pending, ended = life.pending, life.ended
    if pending is not None and pending.scoped:
        origin, taken, peeks = pending.origin, life._finished_count(), pending.peeks
    elif pending is None and ended is not None and ended.trained and ended.own and life.owed is None:
        origin, taken, peeks = ended.origin, ended.origin.taken + ended.handed, ended.peeks
    else:
        return None
    entry = _entry(origin, True, peeks, True, taken, True)
    entry["scoped"] = True
    return entry


def restore(life: "Lifecycle", state: Mapping[str, Any], where: str) -> None:
    """After the loader took ``state``'s position: the phase, and the pass waiting to be continued."""
    life.anchor()
    life.leave_boundary()
    life.moved()
    loader = life._loader
    entry = state.get(PASS)
    life.phase = Phase.RESTORED
    if entry is None and loader._epoch_complete_at_restore():
        # Written at an epoch's end by an earlier release, which recorded it as the last batch taken.
        taken = loader._batches_taken()
        loader._end_epoch()
        entry = {"origin": PassOrigin(loader._epoch - 1, "restored", 0).to_state(), "trained": False,
                 "peeks": 0, "complete": True, "taken": taken}
    if entry is None:
        return
    check_entry({PASS: entry}, where)
    life.trains = life.trains or entry.get("trains", False)
    origin = PassOrigin.from_state(entry["origin"], where)
    complete = bool(entry.get("complete", False))
    if complete:
        life.phase = Phase.EXHAUSTED
    same_topology = not loader._relaid(state)  # else the finished epoch's batches are counted at this size
    scoped = bool(entry.get("scoped", False))
    life.pending = Continuation(origin, entry["trained"], entry["peeks"], loader._raw_state(), complete,
                                entry.get("taken", 0) if same_topology else None, scoped, _training.events())
    life._replays_left = entry["peeks"]


def _entry(origin: PassOrigin, trained: bool, peeks: int, complete: bool, taken: int, trains: bool) -> dict:
    entry = {"origin": origin.to_state(), "trained": trained, "peeks": peeks}
    if complete:
        entry.update(complete=True, taken=taken)
    if trains:  # a resumed run puts back the untrained batches of a pass it has not trained on yet, too
        entry["trains"] = True
    return entry


def untrained(life: Any, record: Any) -> int:
    """The batches ``record`` (a pass of a loader the model trains on) handed out after its last training step; for
    a prefetcher thread's pass, those beyond one a ``backward()``."""
    if record.off_thread:
        return max(record.handed - record.backwards, 0)
    if record.several or (record.steps < 2 and life.one_a_step is False):
        return max(record.handed - record.trained_at, 0)
    return max(record.handed - record.steps, 0)
