"""Running the ``accelerate-stateful`` command line in tests: in this process (breadth) or as a real
``python -m accelerate_stateful`` subprocess (truth), and writing checkpoints of simulated ranks."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from accelerate_stateful.checkpoint import _files
from accelerate_stateful.cli._main import main

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args: Any) -> tuple[int, str, str]:
    """``main(args)`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main([str(a) for a in args])
    return status, out.getvalue(), err.getvalue()


def cli_json(*args: Any) -> Any:
    status, out, err = run_cli(*args, "--json")
    assert status == 0, f"accelerate-stateful {args} exited {status}: {err}"
    return json.loads(out)


def subprocess_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "ACCELERATE_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def run_subprocess(command: Sequence[str], timeout: int = 120, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in command], cwd=cwd, env=subprocess_env(), capture_output=True,
                          text=True, timeout=timeout)


def run_module(*args: Any) -> subprocess.CompletedProcess:
    """The real command line: ``python -m accelerate_stateful ARGS``."""
    return run_subprocess([sys.executable, "-m", "accelerate_stateful", *args])


def run_importtime(*args: Any) -> tuple[int, set, str]:
    """(status, top-level packages imported, stdout) of ``python -X importtime -m accelerate_stateful ARGS``: the
    report on stderr names every module the process imported."""
    done = run_subprocess([sys.executable, "-X", "importtime", "-m", "accelerate_stateful", *args])
    names = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    return done.returncode, {name.split(".")[0] for name in names} - {"import time:"}, done.stdout


def save_checkpoint(path: Path, states_per_loader: Sequence[Sequence[dict]]) -> Path:
    """A complete checkpoint of simulated ranks: ``states_per_loader[loader][rank]``, then the manifest."""
    world = len(states_per_loader[0])
    for loader, states in enumerate(states_per_loader):
        for rank, state in enumerate(states):
            _files.write_loader_state(path, loader, rank, state)
    _files.write_manifest(path, world_size=world, num_loaders=len(states_per_loader))
    return path
