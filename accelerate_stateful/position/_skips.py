"""Samples left out of an epoch: ranges of positions in its order (a loss spike's batches), pure.

A range ``(epoch, start, stop)`` leaves out positions ``start .. stop-1`` of that epoch's order, in the order's own
coordinates (the same for every number of processes, workers and batch size). The epoch is then read as its order
without them, and ``samples_consumed`` counts positions of that shorter order: ranges only ever lie at or after the
position already reached, so the positions before it keep their meaning, and the plan arithmetic (``_plan``)
stripes the shorter order as it stripes any.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:  # the command line reads saved ranges through this module and must not import torch
    import torch

from ..errors import UnsupportedConfigError


def merged(ranges: Sequence[Sequence[int]]) -> list[list[int]]:
    """``ranges`` sorted, with overlapping or touching ranges of one epoch joined (the state's form)."""
    out: list[list[int]] = []
    for epoch, start, stop in sorted(tuple(r) for r in ranges):
        if out and out[-1][0] == epoch and start <= out[-1][2]:
            out[-1][2] = max(out[-1][2], stop)
        else:
            out.append([epoch, start, stop])
    return out


def of_epoch(ranges: Sequence[Sequence[int]], epoch: int) -> list[tuple[int, int]]:
    """The ``(start, stop)`` ranges of ``epoch``, sorted."""
    return [(start, stop) for e, start, stop in ranges if e == epoch]


def count(ranges: Sequence[Sequence[int]], epoch: int) -> int:
    """How many positions of ``epoch`` are left out."""
    return sum(stop - start for start, stop in of_epoch(ranges, epoch))


def kept(indices: "torch.Tensor", ranges: Sequence[Sequence[int]], epoch: int) -> "torch.Tensor":
    """The epoch's ``indices`` without the positions left out."""
    spans = of_epoch(ranges, epoch)
    if not spans:
        return indices
    import torch

    keep = torch.ones(len(indices), dtype=torch.bool)
    for start, stop in spans:
        keep[start:stop] = False
    return indices[keep]


def reached(consumed: int, ranges: Sequence[Sequence[int]], epoch: int) -> int:
    """The position in the full order of the first sample not yet taken, ``consumed`` samples of the shorter order
    being taken (ranges starting at it are skipped over: nothing of them was taken)."""
    position = consumed
    for start, stop in of_epoch(ranges, epoch):
        if start > position:
            break
        position += stop - start
    return position


def check_new(ranges: Sequence[Sequence[int]], epoch: int, start: Any, stop: Any, *, current_epoch: int,
              consumed: int, length: int) -> None:
    """Refuse a range that is not ``0 <= start < stop <= length`` integers, or that reaches back into what the loader
    already took (``consumed`` samples of ``current_epoch``)."""
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (epoch, start, stop)):
        raise UnsupportedConfigError(
            f"skip_samples({start!r}, {stop!r}, epoch={epoch!r}) needs integers; pass the range of positions in the "
            "epoch's order as ints"
        )
    if not 0 <= start < stop <= length:
        raise UnsupportedConfigError(
            f"skip_samples({start}, {stop}) is outside the epoch's {length} samples; pass 0 <= start < stop <= "
            f"{length} (positions in the epoch's order: step k of an epoch on one setup holds positions "
            "k * total_batch_size to (k + 1) * total_batch_size)"
        )
    if epoch < current_epoch:
        raise UnsupportedConfigError(
            f"skip_samples(..., epoch={epoch}): the loader is already in epoch {current_epoch}; samples of a past "
            "epoch cannot be left out any more, resume from a checkpoint saved before them"
        )
    first = reached(consumed, ranges, epoch) if epoch == current_epoch else 0
    if start < first:
        raise UnsupportedConfigError(
            f"skip_samples({start}, {stop}, epoch={epoch}): the loader already took the samples of epoch {epoch} "
            f"before position {first}; resume from a checkpoint saved before position {start}, then call "
            "skip_samples before iterating"
        )


def check_saved(ranges: Any, where: str) -> list[list[int]]:
    """A saved list of ranges, once it is one (else the state is damaged)."""
    valid = isinstance(ranges, list) and all(
        isinstance(r, list) and len(r) == 3 and all(isinstance(v, int) and not isinstance(v, bool) for v in r)
        and r[0] >= 0 and 0 <= r[1] < r[2] for r in ranges
    )
    if not valid:
        raise UnsupportedConfigError(
            f"cannot resume{where}: invalid skipped samples {ranges!r} (expected [epoch, start, stop] lists); the "
            "state is damaged or was edited by hand, resume from another checkpoint"
        )
    return merged(ranges)
