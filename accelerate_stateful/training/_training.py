"""Whether the model was trained on a pass's batches: the signal that tells a truncated epoch from a peek.

A pass over a loader that is dropped before its end (``break``, the longer loader of a ``zip``, a
warm-up ``next(iter(dl))``) means one of two things, and the loader alone cannot tell which: the
training loop truncated its epoch (the next pass is the next epoch), or the loop only looked at a
batch (the next pass starts where this one began). What separates them is whether the model was
trained on the pass's batches. This module decides it from program order only, the same on every
rank whatever the garbage collector does:

- a pass is *current* from the moment it hands out a batch until a pass opened before it hands out
  one (the loop around it moved on: ``for batch in train: ...; for v in eval: ...``), or it ends;
- a *training event* marks every current pass as trained. Training events are every
  ``accelerator.backward()`` of this package's ``Accelerator``, every ``optimizer.step()`` of any
  ``torch.optim`` optimizer (a global post-step hook), and every backward pass that reaches a
  parameter of a prepared model (``loss.backward()`` and a manual update included).

A pass's "trained" mark is part of the loader state, so a resumed run knows what the pass it
continues had done.

The training events with no batch of a pass taken between them are one *training step* of that pass. Each
pass counts its steps, the batches it had handed out at its last one (``trained_at``), and whether a step after
its first took several batches (``several``): from these the lifecycle tells the batches handed out but not
trained yet (a look-ahead prefetcher's, the batch of a step saved at its top), which a checkpoint puts back
(``Lifecycle.put_back``). A pass that reached its end with batches not trained yet stays current while the loop
trains them: each ``next()`` the loop still asks of it (``polls``, answered ``StopIteration``) takes part in a
step as a batch would.

A pass whose batches a prefetcher thread takes (``off_thread``) hands them out at moments that depend on timing,
so none of the above is read from it: each ``accelerator.backward()`` while it is current trains one of its batches
(``backwards``), and the rest count as fetched ahead. The current passes are changed under ``_lock``.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook


class Marked(Protocol):
    """What this module needs of a pass: its opening order, a trained flag, and its batch counts."""

    serial: int
    trained: bool
    handed: int
    polls: int
    taken_at: int
    step_events: int
    per_step: int
    closed: bool
    last_hand: int
    foreign: bool
    own: bool
    dropped: bool
    trained_at: int
    steps: int
    several: bool
    off_thread: bool
    backwards: int


_current: list = []  # the current passes, in the order they became current
_serial = 0
_untracked = 0  # training events while no pass was current: batches from a loader this package does not see
_events = 0  # training events so far in this process
_hooked = False
_WATCHED = "_accelerate_stateful_watched"
_lock = threading.Lock()  # a prefetcher thread hands out batches while the training thread trains


def next_serial() -> int:
    """A number for a new pass: passes opened later have larger numbers (any loader, this process). Opening and
    handing out share the count, so a pass's ``serial`` also tells which batches were handed out before it."""
    global _serial
    with _lock:
        _serial += 1
        return _serial


def handed_out(record: Marked, went_on: bool = True) -> None:
    """``record``'s pass handed out a batch: it is current; passes opened after it no longer are. A current pass
    whose last batch came before ``record``'s pass was opened shares its next step with a later loop (an
    evaluation at the end of an epoch, then the next epoch's training): that step is not its own.

    ``went_on``: the batch took the program past its saved point (:func:`went_on`; not a re-run peek's).
    """
    global _serial, _events
    # A prefetcher thread hands out batches while the training thread trains. (acquire and release: a ``with``
    # statement costs twice as much, on every batch.)
    _lock.acquire()
    try:
        _serial += 1
        _events += went_on
        record.last_hand = _serial
        record.foreign = False
        if len(_current) != 1 or _current[0] is not record:  # a plain loop has nothing else to look at
            _others_handed_out(record)
    finally:
        _lock.release()


def _others_handed_out(record: Marked) -> None:
    """:func:`handed_out` where other passes are current, or ``record`` is not yet (under ``_lock``)."""
    stale = False
    for other in _current:
        if other.last_hand < record.serial:
            other.foreign = True
            # A pass the loop let go before this later pass began (a warm-up ``next(iter(a))``, then
            # ``chain(islice(b, k), a)`` trains ``b``) is not trained by it. Let go is a flag its iterator's
            # finalizer sets; an iterator a reference cycle keeps on one rank only stays current there, and the
            # save's comparison refuses on every rank.
            stale = stale or other.dropped
    if stale:
        _current[:] = [p for p in _current if not (p.dropped and p.last_hand < record.serial)]
    _current[:] = [p for p in _current if p.serial < record.serial]
    _current.append(record)


def ended(record: Marked) -> None:
    """``record``'s pass ended (exhausted, closed or judged): it is no longer current."""
    with _lock:
        if record in _current:
            _current.remove(record)


def note_trained(*_: Any, backward: bool = False) -> None:
    """A training event: every current pass was trained, on every batch it handed out so far (with none current,
    the batches came from elsewhere). ``backward``: it is an ``accelerator.backward()``."""
    global _untracked, _events
    with _lock:
        _events += 1
        if not _current:
            _untracked += 1
        for record in _current:
            record.trained = True
            if record.off_thread:
                record.backwards += backward
                record.own = record.own or bool(backward)
                continue
            taken = record.handed + record.polls  # a ``next()`` past the pass's end takes part in a step too
            if taken > record.taken_at:  # a batch taken since the pass's last training event: a new step
                if record.steps and taken - record.taken_at > 1:
                    record.several = True  # a step after the first took several batches (not a look-ahead)
                record.steps += 1
                record.taken_at, record.trained_at = taken, record.handed
                record.per_step, record.step_events = record.step_events, 1
                record.own = not record.foreign
            else:
                record.step_events += 1
                if record.closed and record.per_step and record.step_events > record.per_step:
                    # After its end, a loop that no longer asks it (a generator draining its own queue): a step is
                    # as many training events as the pass's last step before had.
                    record.steps += 1
                    record.step_events = 1


def events() -> int:
    """A program-order clock: training events, batches handed out and passes ended (:func:`went_on`).
    ``Lifecycle`` reads from it whether the program went past its saved point since a resume."""
    return _events


def went_on() -> None:
    """A pass handed out a batch or ended (not a re-run peek, not an ended pass's empty rest): a resumed program
    went past its saved point."""
    global _events
    with _lock:
        _events += 1


def untracked_events() -> int:
    """How many training events so far in this process came while no prepared loader's pass was current."""
    return _untracked


def install() -> None:
    """Count every ``optimizer.step()`` in this process (idempotent; one loop over the current passes)."""
    global _hooked
    if not _hooked:
        register_optimizer_step_post_hook(note_trained)
        _hooked = True


def watch(model: torch.nn.Module) -> None:
    """Make every backward pass that reaches a trainable parameter of ``model`` a training event."""
    for param in model.parameters():
        if param.requires_grad and not getattr(param, _WATCHED, False):
            param.register_post_accumulate_grad_hook(note_trained)
            setattr(param, _WATCHED, True)
