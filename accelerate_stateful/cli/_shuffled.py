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
    """For each ``k`` of ``ks`` (each below the anchor's ``draws``), the read number of the item handed out as ``k``."""
    from ..sources._draws import Draws  # numpy (not torch), for a Shuffled's samples only

    draw, size, last, ends = Draws(anchor["seed"], epoch), anchor["buffer_size"], anchor["read"], anchor["ended"]
    wanted, found = set(ks), {}
    slots: list[int] = []
    read, ended = 0, False
    for t in range(anchor["draws"]):
        while not ended and len(slots) < size:
            if read == last:  # the source has no item left
                ended = _ends(ends, anchor)
                break
            slots.append(read)
            read += 1
        if not slots:
            raise _diverged(anchor)
        slot = draw(t) % len(slots)
        if t in wanted:
            found[t] = slots[slot]
        if not ended and read < last:
            slots[slot], read = read, read + 1
            continue
        ended = ended or _ends(ends, anchor)
        slots[slot] = slots[-1]
        slots.pop()
    if read != last or ended != ends or slots != list(anchor["slots"]):
        raise _diverged(anchor)
    return [found[k] for k in ks]


def _ends(ends: bool, anchor: Mapping[str, Any]) -> bool:
    """The replay read every item the buffer had read: the source ended there, if the position says so."""
    if not ends:
        raise _diverged(anchor)
    return True


def _diverged(anchor: Mapping[str, Any]) -> NotAnswerable:
    return NotAnswerable(
        f"the saved buffer of a Shuffled (seed={anchor['seed']}, buffer_size={anchor['buffer_size']}) is not the "
        "one its draws give from the epoch's start: the epoch was resumed with another seed, so which item each "
        "sample was cannot be told from the checkpoint; checkpoints of an epoch run with one seed can"
    )
