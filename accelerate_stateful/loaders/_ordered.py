"""One rule for ``DataLoader(in_order=False)``: refused with workers, harmless without.

``in_order=False`` lets torch hand over a batch as soon as any worker has it,
so which batches the training loop has taken depends on how fast each worker
was. The position of an epoch is then no longer "the first k batches", and a
resume would lose some batches and repeat others. Without workers every batch
is made in order anyway, so the setting changes nothing and is accepted.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import UnsupportedConfigError


def require_in_order(settings: Mapping[str, Any]) -> None:
    """Refuse ``in_order=False`` on a loader with workers, saying why and the fix."""
    if settings.get("in_order", True) is False and (settings.get("num_workers") or 0) > 0:
        raise UnsupportedConfigError(
            f"DataLoader(in_order=False) with num_workers={settings['num_workers']} hands over each batch as soon "
            "as any worker has it, so the batches taken before a checkpoint depend on the workers' speed and a "
            "resume would lose some and repeat others; pass in_order=True (the default) to resume exactly"
        )
