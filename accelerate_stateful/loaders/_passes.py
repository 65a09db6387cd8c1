"""A pass over a loader: what ``iter(loader)`` returns, and the record the loader keeps of it.

The record (:class:`PassRecord`) belongs to the loader and holds everything the lifecycle decides
from: where the pass began, whether the model was trained on it, how many batches it handed out.
The iterator (:class:`PassHandle`) belongs to the training loop. When the loop lets the iterator go,
the only thing that happens is that the record is flagged as dropped: no verdict is taken and no
shared state is touched in a finalizer, which may run at any moment and in any thread (whichever
triggers a garbage collection). The verdict is taken by the loader, on the thread that makes the call, at
its next event (``iter()``, ``set_epoch``, ``close()``, ``load_state_dict``; never a query: ``_lifecycle``),
and ``save_state``/``load_state`` collect garbage at the same program point on every rank before they
look, so every rank decides the same.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional

from ..errors import UnsupportedConfigError
from ..training import _record_switch

if TYPE_CHECKING:
    from ._adapter import DataLoaderAdapter

PASS = "pass"  # the state key of the live pass's record

class Phase(enum.Enum):
    """Where a loader is in its lifecycle (see ``docs/lifecycle.md``)."""

    NOT_STARTED = "not started"
    ITERATING = "iterating"
    EXHAUSTED = "exhausted"
    RESTORED = "restored"


class Kind(enum.Enum):
    """What a pass is to the run (``_lifecycle`` explains replays and continuations)."""

    NORMAL = "normal"
    REPLAY = "replay"  # after a resume: a re-run of a pass the saving run made before its live pass
    CONTINUATION = "continuation"  # after a resume: the saving run's live pass, going on


@dataclass(frozen=True)
class PassOrigin:
    """Where a pass began: enough to undo it.

    Attributes:
        epoch: The loader's epoch when the pass began.
        phase: The lifecycle phase to return to when the pass is undone (a ``Phase`` value).
        taken: Batches of the epoch already taken when the pass began.
        mark: The loader state to return to, or ``None`` for the start of ``epoch``.
    """

    epoch: int
    phase: str
    taken: int
    mark: Optional[Mapping[str, Any]] = None

    def to_state(self) -> dict:
        return {"epoch": self.epoch, "phase": self.phase, "taken": self.taken, "mark": self.mark}

    @classmethod
    def from_state(cls, entry: Any, where: str) -> "PassOrigin":
        """Read back :meth:`to_state`, refusing a damaged entry in the user's terms."""
        ok = (
            isinstance(entry, Mapping)
            and all(isinstance(entry.get(k), int) and not isinstance(entry.get(k), bool) and entry[k] >= 0
                    for k in ("epoch", "taken"))
            and entry.get("phase") in ("not started", "exhausted", "restored")
            and (entry.get("mark") is None or isinstance(entry.get("mark"), Mapping))
        )
        if not ok:
            raise UnsupportedConfigError(
                f"cannot resume{where}: the record of the pass that was live when it was saved is damaged "
                f"({entry!r}); resume from another checkpoint"
            )
        return cls(entry["epoch"], entry["phase"], entry["taken"], entry["mark"])


class PassRecord:
    """The loader's record of one pass.

    Attributes:
        kind: :class:`Kind`.
        origin: Where the pass began (for a continuation: where the saving run's pass began).
        serial: Opening order among all passes of this process (``_training``).
        trained: Whether the model was trained while the pass was current.
        peeks: Passes the program makes before this one, each dropped untrained (the saving run's count,
            recorded so that a resume recognises their re-runs).
        handed: Batches this pass handed out.
        trained_at: Batches it had handed out at its last training step (``_training``).
        polls: ``next()`` calls answered ``StopIteration`` at and after its end, while it owes batches
            (``Lifecycle.owed``); ``taken_at``: batches and polls at its last training step.
        step_events: Training events in its current step; ``per_step``: in the step before (``_training``).
        last_hand: When it last handed out a batch (on the clock of ``serial``); ``own``: its last step was its
            own (no pass opened after its last batch handed one out before that step); ``foreign``: the next one
            will not be.
        steps: Its training steps (training events with no batch of it taken between them).
        several: A step after its first took several batches (the loop trains on several at once).
        dropped: Set when the loop let the iterator go (the only thing a finalizer does).
        closed: The pass ended and its verdict was taken.
        complete: The pass handed out the epoch's last batch; ``final`` is ``(epoch, batches taken)`` then, and
            ``at_end`` the variant's position before the next epoch began (``DataLoaderAdapter._position_mark``).
        begun: The variant's batches were opened (and the loader registered with Accelerate's GradientState).
        scoped: After a resume, the empty rest of a pass that had ended inside the loops around the saved live
            pass (``_carried.scoped_entry``).
        off_thread: A thread other than the one that prepared the loader took its batches (a prefetcher thread):
            which ones it had taken at a training event or a save is a matter of timing, so its batches trained are
            counted by ``accelerator.backward()`` calls instead (``backwards``), one batch each (``_training``).
    """

    __slots__ = ("kind", "origin", "serial", "trained", "peeks", "handed", "trained_at", "steps", "several",
                 "dropped", "closed", "complete", "final", "at_end", "begun", "polls", "taken_at", "scoped",
                 "step_events", "per_step", "last_hand", "foreign", "own", "off_thread", "backwards")

    def __init__(self, kind: Kind, origin: PassOrigin, serial: int, trained: bool, peeks: int) -> None:
        self.kind, self.origin, self.serial, self.trained, self.peeks = kind, origin, serial, trained, peeks
        self.handed = self.trained_at = self.steps = self.polls = self.taken_at = 0
        self.step_events = self.per_step = self.last_hand = self.backwards = 0
        self.foreign = self.own = self.off_thread = False
        self.several = False
        self.at_end: Any = None
        self.dropped = self.closed = self.complete = self.begun = self.scoped = False
        self.final: tuple[int, int] = (origin.epoch, origin.taken)


class PassHandle:
    """The iterator of one pass: hands out the loader's batches while its pass is the loader's live one.

    A handle whose pass ended (closed by the next ``iter()``, a load, ``set_epoch``) raises
    ``StopIteration``.
    """

    __slots__ = ("_loader", "_record", "_batches", "__weakref__")

    def __init__(self, loader: "DataLoaderAdapter", record: PassRecord) -> None:
        self._loader = loader
        self._record = record
        self._batches: Optional[Iterator[Any]] = None

    def __iter__(self) -> "PassHandle":
        return self

    def __next__(self) -> Any:
        life = self._loader._life
        ident = threading.get_ident()
        if ident != life.owner and ident != life.guest:
            # A prefetcher thread: its batches count as fetched ahead, and the loader's position moves with the
            # pass's bookkeeping under the lock a save's read takes (``Lifecycle.lock``), never half of one without
            # the other. Inside the lock it is the guest, and takes the batch as the owner does.
            with life.lock:
                self._record.off_thread = True
                life.guest = ident
                try:
                    return self.__next__()
                finally:
                    life.guest = None
        record = self._record
        if record.closed:
            if life.owed is record:  # the loop still asks while it trains what the pass handed out last
                record.polls += 1
            raise StopIteration
        if self._batches is None:
            self._batches = life.begin(record)
        try:
            batch = next(self._batches)
        except StopIteration:
            record.polls += 1
            life.exhausted(record)
            raise
        except Exception:  # the pass cannot go on: judged now, its workers stopped, then re-raised
            self._batches = None
            life.failed(record)
            raise
        life.handed(record, self._loader)
        if _record_switch.active is not None:  # `accelerate-stateful check-resume` records what was handed out
            _record_switch.active.batch(batch, self._loader)
        return batch

    def close(self) -> None:
        """End this pass now, an event of the program: its reading stops (its workers end) and the loader
        takes its verdict (``with contextlib.closing(iter(dl)) as it:`` ends an evaluation cut short at once)."""
        batches, self._batches = self._batches, None
        if batches is not None and hasattr(batches, "close"):
            batches.close()
        self._record.dropped = True
        life = self._loader._life
        if life.live is self._record:
            life.settle()

    def __del__(self) -> None:
        # Only a flag: this may run in any thread, at any moment, or while the interpreter shuts down.
        self._record.dropped = True


def check_entry(state: Mapping[str, Any], where: str) -> Optional[Mapping[str, Any]]:
    """Refuse a damaged ``"pass"`` entry in the user's terms; returns the state its pass began from, if any."""
    entry = state.get(PASS)
    if entry is None:
        return None
    peeks = entry.get("peeks") if isinstance(entry, Mapping) else None
    taken = entry.get("taken", 0) if isinstance(entry, Mapping) else None
    if not (isinstance(entry, Mapping) and isinstance(entry.get("trained"), bool)
            and all(isinstance(entry.get(k, False), bool) for k in ("complete", "trains", "scoped"))
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (peeks, taken))):
        PassOrigin.from_state(None, where)  # raises, saying the record is damaged
    return PassOrigin.from_state(entry.get("origin"), where).mark
