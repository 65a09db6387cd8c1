"""The lifecycle of a loader's passes, decided by program order (see ``docs/lifecycle.md``).

The rules, each held here by construction:

- **One live pass.** ``iter()`` ends the loader's live pass first (the old iterator then raises
  ``StopIteration``).
- **The end of an epoch is the start of the next.** When a pass hands out the last batch of its epoch
  (of every rank's share), the position is the start of the next epoch at once: a checkpoint taken there
  resumes *between* the two epochs (see :meth:`Lifecycle.boundary`).
- **A pass dropped before its epoch's end** (``break``, an exception, the longer loader of a ``zip``, a
  peek, the next ``iter()``) ends its epoch if the model was trained while it was current
  (``training._training``), and is undone otherwise: the loader goes back to where the pass began.
- **Queries read; events decide.** Letting an iterator go only flags its pass (``_passes``); the verdict is
  taken at the loader's next *event* (a new ``iter()``, ``set_epoch``/``seek``, ``load_state_dict``, an
  explicit ``close()``), on the calling thread, and never by a query (``epoch``, ``phase``, ``state_dict()``...),
  which a program may make on one process only. ``save_state``/``load_state`` collect garbage where a pass is
  open (a program-order fact) and take every pending verdict at the same point on every rank.
- **Batches not trained yet are put back at a save.** The batches a live pass handed out after the last
  training event of a loader the model trains on (a look-ahead prefetcher's next batch, the batch of a step
  saved at its top) are not part of the position a checkpoint records (:meth:`Lifecycle.put_back`,
  ``_putback``): the resumed run hands them out again, as the uninterrupted run trains them next.
- **What a pass has done is in the state.** A pass live at a save is recorded with where it began, whether
  it was trained, and how many untrained passes the program made before it (``peeks``). After a resume,
  the first ``peeks`` passes that are dropped untrained are re-runs of those (a warm-up peek, a shape
  check at the top of the epoch): they read from the restored position and are undone; the next pass,
  or the first that is trained, continues the saved pass, with its origin and its "trained" mark.
"""

from __future__ import annotations

import copy
import gc
import threading
import weakref
from typing import TYPE_CHECKING, Any, Iterator, Optional

from ..training import _training
from . import _holders, _putback
from ._carried import Continuation, untrained
from ._passes import Kind, PassHandle, PassOrigin, PassRecord, Phase

if TYPE_CHECKING:
    from ._adapter import DataLoaderAdapter

class Lifecycle:
    """The phase, the live pass, and the verdicts of one loader's passes."""

    def __init__(self, loader: "DataLoaderAdapter") -> None:
        # A proxy: the loader owns its lifecycle, and a cycle between them would leave a dropped loader (and
        # its persistent workers) to the garbage collector, freed at a moment that differs between ranks.
        self._loader = weakref.proxy(loader)
        self.phase = Phase.NOT_STARTED
        self.live: Optional[PassRecord] = None
        self._handle: Optional[weakref.ref] = None
        self.pending: Optional[Continuation] = None
        self._replays_left = 0
        self._streak = 0  # passes undone since the anchor, before the first pass that was not
        self._prologue: Optional[int] = None
        self.trains = False  # the model was trained on a pass of this loader (this run, or the one it resumes)
        self.ended: Optional[PassRecord] = None  # the last pass, if it ended its epoch and no pass began since
        # A pass that ended before the loop trained its last batches (a look-ahead prefetcher draining its queue):
        # a save puts back those not trained yet, and once all are, a save is inside the loop at its epoch's end.
        self.owed: Optional[PassRecord] = None
        self.one_a_step: Optional[bool] = None  # an earlier pass of this process trained one batch a step
        self._own_thread()
        _training.install()

    def _own_thread(self) -> None:
        """The thread that prepared the loader owns it; another thread's ``next()`` (a prefetcher thread) moves the
        position under ``lock``, which a save's read of the position takes too (briefly: one batch's reading)."""
        self.owner = threading.get_ident()
        self.lock = threading.RLock()
        self.guest: Optional[int] = None  # another thread handing out a batch, while it holds ``lock``

    def __getstate__(self) -> dict:
        """A copy of the loader (pickled) has no iterator: its live pass is one let go."""
        state = self.__dict__.copy()
        state["_handle"] = state["_loader"] = None  # the loader's __setstate__ gives the copy its own
        del state["lock"], state["owner"], state["guest"]
        if self.live is not None:
            state["live"] = copy.copy(self.live)
            state["live"].dropped = True
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._own_thread()

    # ----------------------------------------------------------------- queries
    def has_open_pass(self) -> bool:
        """Whether a pass is open: begun and not yet judged. A program-order fact, the same on every rank.

        A pass the loop let go stays open until the loader's next event (``iter()``, ``set_epoch``, a
        checkpoint's save or load): nothing before then depends on when its iterator was freed.
        """
        return self.live is not None

    def is_live(self, collected: bool = False) -> bool:
        """Whether the program still reaches an iterator of this loader's pass that has not ended.

        Reachable, not merely not yet collected: while a pass is open (a program-order fact, so every rank
        collects at the same point) garbage is collected first, so an iterator only a reference cycle keeps
        (an exception kept in a variable) is let go, and the answer is the same on every rank.

        Args:
            collected: The caller collected garbage at this event already (a checkpoint's save or load
                collects once for all of its loaders: one full collection, not one per loader).
        """
        if self.live is not None and not collected:
            gc.collect()
        self.settle()
        return self.live is not None

    def held_through_a_traceback(self) -> Optional[str]:
        """Where the live pass's iterator is held only by a finished frame a kept exception keeps (a query;
        ``_holders``), in words; ``None`` otherwise."""
        handle = self._handle() if self._handle is not None else None
        return None if handle is None else _holders.kept_by_a_traceback(handle)

    def anchor(self) -> None:
        """Start counting the program's untrained passes anew (at prepare, a load, a resume that found nothing)."""
        self.settle()
        self._streak, self._prologue = 0, None

    def boundary(self) -> Optional[tuple[int, int]]:
        """After a resume between two epochs: ``(finished epoch, its batches)`` until the program moves on.

        A checkpoint taken after an epoch's last batch (inside the loop) resumes between that epoch and the
        next, and the next pass goes on in the finished epoch, as after any save inside the loop: its rest is
        empty, so the code after the inner loop runs as in the uninterrupted run, then the next pass reads the
        next epoch. Only the program's moves decide otherwise (``set_epoch`` with the next epoch, ``seek``,
        ``skip_first_batches``): never a query, so a question asked on one process only changes nothing. A pass
        that ended inside another loader's live pass is re-entered so until the program trains
        (``_carried.scoped_entry``).
        """
        pending = self.pending
        if pending is None or not pending.complete or (pending.scoped and not self._in_window(pending)):
            return None
        return pending.origin.epoch, self._finished_count()

    def _in_window(self, pending: Continuation) -> bool:
        """Whether the program has not gone past the point it was saved at since the resume (it has not trained,
        and no pass handed out a batch or ended, re-run peeks and ended passes' empty rests aside): it is still
        re-entering the loops around the saved live pass, so a pass that had ended there is re-entered as ended
        (``_carried.scoped_entry``)."""
        return _training.events() == pending.window

    def _finished_count(self) -> int:
        """The finished epoch's batches, all taken: as saved on this topology, else this loader's length."""
        taken = self.pending.taken
        return taken if taken is not None else self._loader._all_taken()

    def leave_boundary(self) -> None:
        """``set_epoch``/``seek`` moved the loader: the saved pass will not be continued."""
        self.pending, self._replays_left = None, 0

    def moved(self) -> None:
        """The program moved the loader (a new pass, ``set_epoch`` to another epoch, ``seek``, a load): the pass
        that ended before is no longer the last word on where the loader stands."""
        if self.owed is not None:
            _training.ended(self.owed)
        self.ended = self.owed = None

    # ----------------------------------------------------------------- opening
    def open(self, loader: "DataLoaderAdapter") -> PassHandle:
        """``iter(loader)``: end the live pass, then start a new one where the loader stands.

        The handle holds ``loader`` itself (this lifecycle holds only a proxy): an iterator keeps its loader.
        """
        self.settle()
        if self.live is not None:
            handle = self._handle() if self._handle is not None else None
            if handle is not None:
                handle.close()  # an event: takes the verdict
            if self.live is not None:
                self._judge(self.live)
        self.moved()
        record = self._new_record()
        handle = PassHandle(loader, record)
        self.live, self._handle = record, weakref.ref(handle)
        return handle

    def _new_record(self) -> PassRecord:
        loader, serial = self._loader, _training.next_serial()
        pending = self.pending
        if pending is not None and pending.scoped and not self._in_window(pending):
            self.leave_boundary()  # the program trained since the resume: this is its next pass, as uninterrupted
            pending = None
        if pending is not None and self._replays_left > 0:
            return PassRecord(Kind.REPLAY, pending.origin, serial, False, pending.peeks)
        if pending is not None and not pending.complete:
            self.pending = None
            record = PassRecord(Kind.CONTINUATION, pending.origin, serial, pending.trained, pending.peeks)
            record.own = pending.trained  # until a step of its own, its last step is the saved pass's
            return record
        if pending is not None:  # between two epochs: the pass goes on in the finished one, whose rest is empty
            record = PassRecord(Kind.CONTINUATION, pending.origin, serial, pending.trained, pending.peeks)
            record.scoped, record.own = pending.scoped, pending.trained  # it goes on as the saved pass ended
            self._rest_of_finished_epoch(record)
            return record
        self.leave_boundary()
        at_start = self.phase in (Phase.NOT_STARTED, Phase.EXHAUSTED)
        origin = PassOrigin(loader._epoch, self.phase.value, loader._batches_taken(),
                            None if at_start else loader._raw_state())
        peeks = self._prologue if self._prologue is not None else self._streak
        return PassRecord(Kind.NORMAL, origin, serial, False, peeks)

    def begin(self, record: PassRecord) -> Iterator[Any]:
        """The first ``next()``: the variant's batches from where the loader stands."""
        self.phase = Phase.ITERATING
        record.begun = True
        self._loader._begin()
        return iter(()) if record.complete else self._loader._batches()

    def _undo_to(self, origin: PassOrigin) -> None:
        """Back to where a pass began (the phase included)."""
        loader = self._loader
        if origin.mark is None:
            loader._epoch = origin.epoch
            loader._rewind()
        else:
            loader._restore(origin.mark)
            loader._epoch = origin.epoch
        self.phase = Phase(origin.phase)

    def _rest_of_finished_epoch(self, record: PassRecord) -> None:
        """Between two epochs, the pass that re-enters the finished one: its rest, which is empty."""
        pending = self.pending
        record.complete = True
        record.final = (pending.origin.epoch, self._finished_count())
        self.leave_boundary()

    # ----------------------------------------------------------------- events of a pass
    def handed(self, record: PassRecord, loader: "DataLoaderAdapter") -> None:
        """The pass handed a batch to the loop (``loader``: this lifecycle's, as the pass's handle holds it; on every
        batch, a plain reference costs less than the proxy this lifecycle keeps)."""
        record.handed += 1
        # Read once, and passed by position: CPython specialises neither a class attribute of an enum nor a call
        # with a keyword argument, at every batch.
        replay = record.kind is Kind.REPLAY
        _training.handed_out(record, not replay)  # a re-run peek is part of re-entering the saved point; a batch is not
        loader._activate()
        if replay and record.trained:  # ``_promote`` changes nothing for another kind
            self._promote(record)
        if loader.end_of_dataloader and loader._epoch_complete():
            self._complete(record)

    def _complete(self, record: PassRecord) -> None:
        """The pass handed out its epoch's last batch: the position is the start of the next epoch (unless the
        pass is dropped untrained: a peek is undone wherever it stopped)."""
        loader = self._loader
        record.final = (loader._epoch, loader._batches_taken())
        record.complete = True
        record.at_end = loader._position_mark()  # a save may still put the epoch's last batches back
        loader._end_epoch()

    def exhausted(self, record: PassRecord) -> None:
        """The pass found no more batches: its epoch is over. If the loop has not trained every batch it handed
        out yet (a look-ahead prefetcher draining its queue), the pass stays current while it does, and a save
        until then puts those batches back (``owed``)."""
        if record.closed:
            return
        self._promote(record)
        if record.kind is not Kind.REPLAY and not record.scoped:
            _training.went_on()
        if not record.complete:
            record.final = (self._loader._epoch, self._loader._batches_taken())
            record.at_end = self._loader._position_mark()
            self._loader._end_epoch()
        # A prefetcher thread's pass ends when the thread reaches its end, a moment that depends on timing: it stays
        # owed its batches, trained or not yet, until the program moves the loader (every rank alike).
        if record.off_thread or (untrained(self, record) > 0 and (self.trains or record.trained)):
            self.owed = record
        self._close(record, undone=False)

    def failed(self, record: PassRecord) -> None:
        """Reading the pass raised: it cannot go on. Its workers stop now; the verdict is a drop's."""
        self._loader._release_workers()
        self._judge(record)

    def settle(self) -> None:
        """Take the verdict of a live pass whose iterator was let go (flagged by its finalizer)."""
        live = self.live
        if live is None:
            return
        if live.trained:
            self._promote(live)
        if live.dropped or (self._handle is not None and self._handle() is None):
            self._judge(live)

    # ----------------------------------------------------------------- verdicts
    def _judge(self, record: PassRecord) -> None:
        """A pass dropped before the loop asked past its end: it ended its epoch, or it is undone."""
        if record.closed:
            return
        loader = self._loader
        if record.trained:
            self._promote(record)
        if record.complete and (record.trained or record.kind is Kind.CONTINUATION):  # the epoch ended already
            undone = False
        elif record.kind is Kind.REPLAY:  # a re-run of a pass the saving run undid: back to the restored position
            self._replays_left -= 1
            loader._restore(self.pending.saved)
            loader._epoch = self.pending.saved["epoch"]
            self.phase, undone = Phase.RESTORED, True
        elif record.trained:
            loader._end_epoch()
            undone = False
        else:
            self._undo_to(record.origin)
            undone = True
        self._close(record, undone)

    def _close(self, record: PassRecord, undone: bool) -> None:
        record.closed = True
        self.trains = self.trains or record.trained
        if record.steps >= 2 and not record.off_thread:
            self.one_a_step = not record.several
        if record is not self.owed:
            _training.ended(record)
        if record.begun:
            self._loader._end()
        if self.live is record:
            self.live, self._handle = None, None
        if undone:
            self._streak += 1
            return
        self.ended = record
        self.phase = Phase.EXHAUSTED
        if self._prologue is None:
            self._prologue = self._streak

    def _promote(self, record: PassRecord) -> None:
        """A re-run that was trained, or read past its epoch's end, was not a re-run: the program moved on.

        Between two epochs it is a pass of the next epoch; otherwise it continues the saved pass.
        """
        pending = self.pending
        if record.kind is not Kind.REPLAY or pending is None:
            return
        if pending.complete:
            record.kind = Kind.NORMAL
            record.origin = PassOrigin(pending.saved["epoch"], "exhausted", 0)
        else:
            record.kind, record.origin, record.peeks = Kind.CONTINUATION, pending.origin, pending.peeks
            record.trained = record.trained or pending.trained
            record.own = record.own or pending.trained
        self.leave_boundary()

    # ----------------------------------------------------------------- state
    def put_back(self, evaluation: bool = False) -> int:
        """How many batches of the live pass a checkpoint puts back (``_putback.count``)."""
        return _putback.count(self, evaluation)

    def replaying(self) -> bool:
        """Whether a re-run pass is live: the state is then the restored one (a re-run is undone)."""
        live = self.live
        return live is not None and live.kind is Kind.REPLAY and self.pending is not None

    def digest(self) -> tuple[tuple, tuple]:
        """What every rank must agree on when a checkpoint is taken or loaded, and this rank's point in full.

        The first part is compared between ranks: the program-order facts (the epoch a live pass began in, what
        was done on it, how many batches it handed out, a resumed pass waiting). The rank's own position in its
        share (batches taken, whether its share of the epoch is complete) is left out of the comparison: with
        uneven shares (a stream per rank, ``even_batches=False``) one rank's share ends a batch before
        another's in the uninterrupted run too. The second part describes the point in words in a refusal.
        """
        self.settle()
        live, loader, pending = self.live, self._loader, self.pending
        waiting_key = None if pending is None else (pending.origin.epoch, pending.trained, self._replays_left)
        thread = live if live is not None else self.owed
        if thread is not None and thread.off_thread:  # the batches it trained; not how far the thread read ahead
            key = (loader.mode, thread.origin.epoch, "thread", thread.kind.value, thread.trained,
                   thread.handed - self.put_back(), waiting_key)
        else:
            live_key = None if live is None else (live.kind.value, live.origin.epoch, live.trained, live.handed,
                                                  self.put_back())
            epoch = loader._epoch if live is None else live.origin.epoch
            key = (loader.mode, epoch, self.phase.value, live_key, waiting_key)
        point = (loader._epoch, loader._batches_taken(), self.phase.value,
                 None if live is None else (live.handed, live.trained), pending is not None)
        return key, point

