"""Each ``make`` target installs what it needs: ``make -n`` (print, run nothing) into a venv that does not exist.

Issue 26: ``make demo`` installed the docs tooling and DeepSpeed, which prints a line at every process start;
``make test`` must still install everything the suite runs (never a test skipped for a missing package).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def _installs(target: str, tmp_path: Path) -> list[str]:
    """What ``make TARGET`` would ``pip install`` into a fresh venv, in order."""
    done = subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'venv'}"], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=True)
    return [m.group(1) for m in re.finditer(r"pip install --quiet (?:--upgrade |-e )?(\S+)", done.stdout)]


def test_make_demo_installs_the_package_alone(tmp_path):
    assert _installs("demo", tmp_path) == ["pip", '"torch==2.13.0"', "."]


def test_make_demo_trainer_adds_the_trainer_integration_and_make_docs_the_docs_tooling(tmp_path):
    assert _installs("demo-trainer", tmp_path)[-1] == '".[transformers]"'
    assert _installs("docs", tmp_path)[-1] == '".[docs]"'


def test_make_test_installs_everything_the_suite_runs(tmp_path):
    installs = _installs("test", tmp_path)
    assert installs[-2:] == ['".[test,deepspeed]"', "--no-deps"]  # then the streaming libraries, without theirs
