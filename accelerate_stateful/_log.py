"""The package's log lines: each names the package, and the lines a run prints once follow Accelerate.

With no logging configured, Python prints a warning's text alone (no logger name), so every line
starts with ``accelerate-stateful:``. The lines that say what a run did (where it resumed, that it found
no checkpoint) are warnings, so they show by default as Accelerate's own notices do, and go through
``accelerate.logging.get_logger``: once per run, on the main process (``ACCELERATE_LOG_LEVEL`` applies).
Lines that can come from a process where no Accelerator exists (a DataLoader worker, a loader used
alone) use :func:`get_logger`, and the caller says which ranks speak.
"""

from __future__ import annotations

import logging
from typing import Any, MutableMapping

PACKAGE = "accelerate-stateful"


class PackageLogger(logging.LoggerAdapter):
    """A logger whose every line starts with the package's name."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return f"{PACKAGE}: {msg}", kwargs


def get_logger(name: str) -> PackageLogger:
    """The logger of module ``name``; every process that calls it logs."""
    return PackageLogger(logging.getLogger(name), {})


class MainProcessLogger(PackageLogger):
    """Accelerate's logger (the main process alone logs); in a process without an Accelerator, this one logs."""

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        from accelerate.state import is_initialized

        if is_initialized():
            super().log(level, msg, *args, **kwargs)
        else:  # Accelerate's logger would raise: a loader used alone speaks for its process
            kwargs.pop("main_process_only", None)
            PackageLogger(self.logger.logger, {}).log(level, msg, *args, **kwargs)


def main_process_logger(name: str) -> MainProcessLogger:
    """Accelerate's logger of module ``name``: the main process alone logs (where an Accelerator exists)."""
    from accelerate.logging import get_logger  # imports torch: only where an Accelerator runs

    return MainProcessLogger(get_logger(name), {})
