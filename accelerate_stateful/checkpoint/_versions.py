"""One refusal for every versioned file format the package reads.

Each format records the version it was written with: the manifest (``manifest_version``), the loader
state (``format_version``) and the ``torch.distributed.checkpoint`` envelope (``envelope_version``).
A reader accepts exactly the versions it knows; anything else (most often a checkpoint written by a
newer release) is refused with the version found, the versions this release reads, and the fix.
"""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointError


class UnknownVersionError(CheckpointError):
    """A checkpoint file of a version this release does not read: refused, never skipped as if damaged."""


def refuse_unknown_version(kind: str, found: Any, supported: tuple[int, ...], where: str,
                           error: type[Exception] = UnknownVersionError) -> None:
    """Raise ``error`` unless ``found`` is one of the ``supported`` versions of ``kind``.

    Examples:
        >>> refuse_unknown_version("manifest_version", 1, (1,), "MANIFEST.json")
    """
    known = isinstance(found, int) and not isinstance(found, bool)
    if known and found in supported:
        return
    why = ("written by a newer release of accelerate-stateful" if known and found > max(supported)
           else "not a version any release wrote")
    raise error(
        f"{where} has {kind}={found!r}, which this release cannot read ({why}); it reads {kind} "
        f"{', '.join(map(str, supported))}: upgrade accelerate-stateful (install the release that wrote it) to "
        "resume from it, or resume from another checkpoint"
    )
