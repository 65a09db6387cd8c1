"""What a pass over a loader leaves behind when it is dropped before its end (see ``docs/lifecycle.md``).

The rule, chosen so that a resumed run always does what the uninterrupted run does:

- a pass dropped while the model was trained (``accelerator.backward()`` or an optimizer step
  ran while it was live), truncated its epoch: the next pass is the next epoch, as with ``set_epoch``;
- any other dropped pass (a warm-up ``next(iter(dl))``, a shape check, an evaluation stopped after a
  few batches, ``iter()`` called twice) is undone: the loader is back where that pass began, and
  ``state_dict()`` records that.

A pass is dropped when its iterator is closed: when the next ``iter()`` starts, or when the last
reference to it goes (in CPython at once, e.g. on ``break`` out of ``for batch in dl``). While an
iterator is still held, the pass is live and ``state_dict()`` is the position after the last batch
the loop took.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..training import _training


@dataclass(frozen=True)
class PassOrigin:
    """Where a pass began: enough to undo it, and to tell what happened while it was live.

    Attributes:
        epoch: The loader's epoch when the pass began.
        phase: The lifecycle phase to return to when the pass is undone.
        mark: The position to return to (``None``: the start of ``epoch``).
        taken: Batches of the epoch already taken when the pass began.
        trained: The process's training-step count when the pass began.
        at_end: Whether the pass began at the end of its epoch (a loader restored after the epoch's last batch).
    """

    epoch: int
    phase: Any
    mark: Optional[Any]
    taken: int
    trained: int
    at_end: bool

    @classmethod
    def of(cls, loader: Any) -> "PassOrigin":
        """Where a pass over ``loader`` (a ``DataLoaderAdapter``) begins, read before it takes anything."""
        phase = loader.phase.value
        return cls(
            epoch=loader.epoch,
            phase=loader.phase,
            mark=None if phase in ("not started", "exhausted") else loader.state_dict(),
            taken=loader._batches_taken(),
            trained=_training.trained_count(),
            at_end=phase == "restored" and loader._at_epoch_end(),
        )

    def truncated_by_training(self, taken_now: int) -> bool:
        """Whether the pass took batches and the model was trained while it was live."""
        return taken_now != self.taken and _training.trained_count() != self.trained


def empty_tail_note(origin: PassOrigin, num_batches: int) -> str:
    """The ``StopIteration`` text of a pass that began at the end of its epoch and so yields nothing."""
    return (
        f"this loader was restored after the last of the {num_batches} batches of epoch {origin.epoch}, so this "
        f"pass yields nothing: code after your inner loop runs once for epoch {origin.epoch}, as in the "
        f"uninterrupted run; the next iter() reads epoch {origin.epoch + 1}. Take a warm-up batch before "
        "resume()/load_state() (a peek there is undone), not after"
    )
