"""Dependency sessions that CI runs after ``make test`` (``.ci/run``); ``docs/compatibility.md`` says what they show.

- ``floor``: the oldest release ``setup.py`` admits of each dependency, on the fast subset below (9 of the
  suite's test files; the rest runs on the pinned set only).
- ``newest``: the newest release of each on PyPI when this file was last updated, on the same subset.
- ``conformance``: Accelerate's own tests with this package's ``Accelerator``, against the pinned release
  (``tools/accelerate_conformance.py``).

``make test`` runs the whole suite on the pinned set (``setup.py``'s ``test`` extra). pip's cache keeps every
wheel between sessions and runs; ``nox -r`` reuses the session environments as well.
"""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["floor", "newest", "conformance"]
nox.options.default_venv_backend = "venv"

# setup.py admits these and no older: each is the oldest release that passes FAST_SUBSET with the others.
FLOOR = {
    "torch": "2.6.0",
    "accelerate": "1.8.0",
    "torchdata": "0.10.0",
    "safetensors": "0.4.3",
    "transformers": "5.3.0",
    "trl": "1.0.0",
    "datasets": "4.7.0",
}
# The newest release of each on PyPI on 2026-11-27.
NEWEST = {
    "torch": "2.15.0",
    "accelerate": "1.15.0",
    "torchdata": "0.11.0",
    "safetensors": "0.8.0",
    "transformers": "5.24.0",
    "trl": "1.16.0",
    "datasets": "5.2.0",
}
# What the subset exercises: prepare, save/load/resume and Accelerate's own load_state, the loader lifecycle
# (one launch of real processes), gradient accumulation, freeing memory, and the Trainer integration.
FAST_SUBSET = [
    "tests/test_accelerator.py",
    "tests/test_lifecycle.py",
    "tests/test_lifecycle_programs.py",
    "tests/test_lifecycle_rules.py",
    "tests/test_lifecycle_mp.py",
    "tests/test_accumulation.py",
    "tests/test_free_memory.py",
    "tests/test_trainer.py",
    "tests/test_teardown.py",
]
TEST_TOOLS = ["pytest>=8", "pytest-timeout>=2.3"]
# pip reads no configuration file in these sessions: a machine's pip.conf may cap torch below NEWEST
# (a constraint file), and these sessions install exactly what they name.
NO_CONFIG = {"PIP_CONFIG_FILE": os.devnull}


def install_set(session: nox.Session, versions: dict) -> None:
    """Exactly ``versions`` (torch first: alone, a range would pull another build), then this package."""
    session.install(f"torch=={versions['torch']}", env=NO_CONFIG)
    session.install(*(f"{name}=={version}" for name, version in versions.items()), *TEST_TOOLS, env=NO_CONFIG)
    session.install("--no-deps", ".")
    session.run("python", "-c", "import importlib.metadata as m, sys; "
                f"print({{name: m.version(name) for name in {sorted(versions)!r}}})")


@nox.session
def floor(session: nox.Session) -> None:
    """The oldest declared release of every dependency, on the fast subset."""
    install_set(session, FLOOR)
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *FAST_SUBSET, *session.posargs)


@nox.session
def newest(session: nox.Session) -> None:
    """The newest release of every dependency, on the fast subset."""
    install_set(session, NEWEST)
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *FAST_SUBSET, *session.posargs)


@nox.session
def conformance(session: nox.Session) -> None:
    """Accelerate's own tests with this package's Accelerator, against the Accelerate release setup.py pins."""
    session.install("torch==2.13.0")
    session.install(".[conformance]")
    session.run("python", "tools/accelerate_conformance.py", *session.posargs)
