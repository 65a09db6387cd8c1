"""The package's exception tree.

Every error a user can trigger derives from :class:`StatefulLoaderError`, so a
training script can catch the whole family in one place::

    StatefulLoaderError
    ├── LifecycleError          an operation the loader's current state forbids
    ├── UnsupportedConfigError  a loader configuration this package cannot resume exactly
    ├── StateMismatchError      a saved state that does not fit the current loader
    ├── StateSerializationError a state value that cannot be stored safely
    └── CheckpointError         a checkpoint folder that is missing, incomplete or damaged
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence


class StatefulLoaderError(Exception):
    """Base class of every error raised by accelerate-stateful."""


class LifecycleError(StatefulLoaderError, RuntimeError):
    """Raised for an operation the loader's lifecycle state forbids.

    Example: ``load_state_dict()`` while an iterator over the loader is live,
    which would otherwise leave the loaded position silently ignored.
    """


class UnsupportedConfigError(StatefulLoaderError, ValueError):
    """Raised when a loader is configured in a way that cannot resume exactly."""


class StateSerializationError(StatefulLoaderError, TypeError):
    """Raised at save time for a state value that JSON and safetensors cannot hold.

    Attributes:
        path: Where the value sits in the state tree, e.g. ``"base/worker_0/buffer"``.
    """

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path


class CheckpointError(StatefulLoaderError, OSError):
    """Raised for a checkpoint folder that is missing, incomplete, damaged or foreign."""


@dataclass(frozen=True)
class Mismatch:
    """One field on which a saved state and the current loader disagree."""

    field: str
    saved: Any
    current: Any


class StateMismatchError(StatefulLoaderError, ValueError):
    """Raised when a saved loader state does not fit the loader it is loaded into.

    The message lists every disagreeing field with its saved and current value,
    and says how to fix it.

    Attributes:
        mismatches: Every field that differs.
        saved: Mapping of field name to the saved value.
        current: Mapping of field name to the current value.
    """

    def __init__(
        self, mismatches: Sequence[Mismatch], fix: str, source: str = "", label: Callable[[str], str] = str
    ) -> None:
        self.mismatches = tuple(mismatches)
        self.saved = {m.field: m.saved for m in self.mismatches}
        self.current = {m.field: m.current for m in self.mismatches}
        lines = "\n".join(
            f"  - {label(m.field)}: saved {m.saved!r}, current {m.current!r}" for m in self.mismatches
        )
        where = f" ({source})" if source else ""
        super().__init__(f"cannot resume{where}: the saved loader state does not fit this loader:\n{lines}\n{fix}")
