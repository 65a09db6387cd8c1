"""Which item of its source a ``Shuffled`` buffer handed out as its item ``k`` (``samples``), replayed in read numbers.

A buffer's draw ``t`` is a pure function of ``(seed, epoch, t)`` (``sources._draws.Draws``), and which slot holds
which item of the source is bookkeeping in the items' read numbers (the items read before each): replayed from the
epoch's start, an empty buffer fills with the read numbers ``0 .. buffer_size - 1``, each draw hands out the number
in the slot it picks and puts the next one there, and once the source has ended the buffer empties. No item is
read. The replay must arrive at the saved buffer exactly (the same number in every slot, the same count read); one
that does not (an epoch resumed with another seed) is refused, never guessed. The numbers found are then named
from the position of the source the buffer recorded after its last read (``to``), as any source's items are.
"""

from __future__ import annotations

from typing import Any, Mapping

from ._read import NotAnswerable

KEYS = {"from", "from_read", "read", "slots", "draws", "ended", "seed", "buffer_size", "to"}


def is_shuffled(position: Any) -> bool:
    """Whether ``position`` is a ``Shuffled`` buffer's that records what ``samples`` replays (its seed and size)."""
    return isinstance(position, Mapping) and set(position) == KEYS


def handed_out(anchor: Mapping[str, Any], ks: list[int], epoch: int) -> list[int]:
    """For each ``k`` of ``ks`` (each below the anchor's ``draws``), the read number of the item handed out as ``k``.

    While the source lasts, each draw ``t`` of a full buffer picks slot ``s_t`` and puts read number
    ``buffer_size + t`` there, so it hands out the number the latest earlier draw of ``s_t`` put there (or ``s_t``,
    filled first): found for every such draw at once with numpy. Once the source has ended, the buffer empties a
    draw at a time, each moving its last slot into the one drawn, replayed one by one (at most ``buffer_size``).
    """
    import numpy as np

    from ..sources._draws import Draws, first_draws  # numpy (not torch), for a Shuffled's samples only

    size, last, ends, stop = anchor["buffer_size"], anchor["read"], anchor["ended"], anchor["draws"]
    if not stop:
        return []
    full = max(0, last - size)  # the draws that read a replacement: the source had ``last`` items
    if full >= stop if ends else last != size + stop:
        raise _diverged(anchor)
    picked = (first_draws(anchor["seed"], epoch, full) % np.uint64(size)).astype(np.int64)
    order = np.argsort(picked, kind="stable")  # the draws of each slot, in order
    same = picked[order[1:]] == picked[order[:-1]]
    put = np.full(full, -1, dtype=np.int64)  # the earlier draw that put the number handed out, if any
    put[order[1:][same]] = order[:-1][same]
    out = np.where(put >= 0, size + put, picked)
    slots = np.arange(min(size, last))
    latest = np.append(~same, True) if full else np.zeros(0, dtype=bool)  # each slot's latest draw
    slots[picked[order[latest]]] = size + order[latest]
    slots, found, draw = slots.tolist(), {}, Draws(anchor["seed"], epoch)
    for t in range(full, stop):  # the source has ended: the buffer empties
        if not slots:
            raise _diverged(anchor)
        slot = draw(t) % len(slots)
        found[t] = slots[slot]
        slots[slot] = slots[-1]
        slots.pop()
    if slots != list(anchor["slots"]):
        raise _diverged(anchor)
    return [found[k] if k >= full else int(out[k]) for k in ks]


def _diverged(anchor: Mapping[str, Any]) -> NotAnswerable:
    return NotAnswerable(
        f"the saved buffer of a Shuffled (seed={anchor['seed']}, buffer_size={anchor['buffer_size']}) is not the "
        "one its draws give from the epoch's start: the epoch was resumed with another seed, so which item each "
        "sample was cannot be told from the checkpoint; checkpoints of an epoch run with one seed can"
    )
