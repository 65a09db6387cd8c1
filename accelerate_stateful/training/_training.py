"""Whether the model was trained: the signal that tells an abandoned training pass from a peek.

A pass over a loader that is dropped before its end (``break``, the longer loader of a ``zip``, a
warm-up ``next(iter(dl))``) means one of two things, and the loader alone cannot tell which: the
training loop truncated its epoch (the next pass is the next epoch), or the loop only looked at a
batch (the next pass must start where this one began). What separates them is whether the model
was trained while the pass was live. This module counts training steps process-wide: every
``accelerator.backward()`` of this package's ``Accelerator`` and every ``optimizer.step()`` of any
``torch.optim`` optimizer (a global post-step hook, installed once), so plain PyTorch loops count too.
"""

from __future__ import annotations

from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook

_count = 0
_hooked = False


def note_trained() -> None:
    """Record one training step (a backward pass or an optimizer step)."""
    global _count
    _count += 1


def trained_count() -> int:
    """Training steps so far in this process; compare two readings to know whether training happened."""
    return _count


def install() -> None:
    """Count every ``optimizer.step()`` in this process (idempotent, cheap: one integer per step)."""
    global _hooked
    if not _hooked:
        register_optimizer_step_post_hook(_on_step)
        _hooked = True


def _on_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    note_trained()
