"""The install the docs give for a project of your own works: ``make dist``'s wheel, with its extras.

The wheel is built as ``make dist`` builds it, installed (without its dependencies, which this environment
has) into a folder of its own, and used from there by a fresh interpreter: the package, every module of it,
the ``transformers`` extra the docs name, and the ``accelerate-stateful`` command.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _build(out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w",
                    str(out), str(ROOT)], check=True, cwd=out)
    (wheel,) = out.glob("accelerate_stateful-*.whl")
    return wheel


def test_the_wheel_holds_every_module_and_declares_the_extras_the_docs_install(tmp_path):
    wheel = _build(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = next(archive.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
        entry_points = next(archive.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    package = {p.relative_to(ROOT).as_posix() for p in (ROOT / "accelerate_stateful").rglob("*.py")}
    assert package - names == set(), "modules missing from the wheel: list their packages in setup.py"
    assert "Provides-Extra: transformers" in metadata
    assert "accelerate-stateful = accelerate_stateful.cli:main" in entry_points
    for doc in ("README.md", *(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))):
        by_name = re.search(r"pip install\s+(-U\s+)?\"?accelerate-stateful\b", (ROOT / doc).read_text())
        assert by_name is None, f"{doc} installs accelerate-stateful by name, which no index has: {by_name[0]}"


def test_the_installed_wheel_is_what_a_fresh_interpreter_imports_and_runs(tmp_path):
    wheel = _build(tmp_path)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                    str(wheel)], check=True)
    env = {**os.environ, "PYTHONPATH": str(target)}
    found = subprocess.run([sys.executable, "-c", "import accelerate_stateful as a; print(a.__file__); "
                            "from accelerate_stateful import Accelerator, ShardDataLoader"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, check=True).stdout
    assert Path(found.strip()).is_relative_to(target)
    command = subprocess.run([sys.executable, "-m", "accelerate_stateful", "--help"], capture_output=True,
                             text=True, env=env, cwd=tmp_path)
    assert command.returncode == 0 and "inspect" in command.stdout, command.stderr
