"""The README's quick start is a complete script (``examples/quickstart.py``) that runs as written.

It is run on 2 real processes (gloo) from a folder of its own: once uninterrupted, and once SIGKILLed after
its third checkpoint and started again with the same command. The resumed run ends with the same weights,
bit for bit, in the same last checkpoint, and it saved mid-epoch (its saves are not on Accelerate's
per-epoch ``accelerator.step``).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

import mp_harness
from accelerate_stateful.checkpoint import _files

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "quickstart.py"


def test_the_readme_shows_the_quick_start_script_whole():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert SCRIPT.read_text() in blocks, "README.md's quick start must be examples/quickstart.py, whole"


def _in_folder(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """A script that runs the quick start with ``name`` as its working directory (its runs/ folder goes there)."""
    folder = tmp_path / name
    folder.mkdir()
    wrapper = folder / "run_quickstart.py"
    wrapper.write_text(f"import os, runpy\nos.chdir({str(folder)!r})\nrunpy.run_path({str(SCRIPT)!r}, "
                       "run_name='__main__')\n")
    return folder, wrapper


def _weights(folder: Path) -> bytes:
    newest = _files.numbered_checkpoints(folder / "runs" / "quickstart" / "checkpoints")[0]
    return (newest / "model.safetensors").read_bytes()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_quick_start_killed_after_a_mid_epoch_save_and_run_again_ends_as_the_uninterrupted_run(tmp_path):
    whole, script = _in_folder(tmp_path, "uninterrupted")
    done = mp_harness.launch(mp_harness.accelerate_command(script, []), whole / "launch", timeout_s=120)
    assert done.ok, done.report()
    assert "done: epoch 3" in done.output

    killed, script = _in_folder(tmp_path, "killed")
    command = mp_harness.accelerate_command(script, [])
    job = mp_harness.start(command, killed / "launch1")
    third = killed / "runs" / "quickstart" / "checkpoints" / "checkpoint_2"
    deadline = time.monotonic() + 120
    while not _files.has_manifest(third) and time.monotonic() < deadline and not job.ended():
        time.sleep(0.2)
    job.kill()
    assert _files.has_manifest(third), "the run did not write its third checkpoint"
    again = mp_harness.launch(command, killed / "launch2", timeout_s=120)
    assert again.ok, again.report()
    assert "done: epoch 3" in again.output

    # 32 batches a rank per epoch, a save every 10: 9 saves, 3 of them kept, all mid-epoch
    kept = _files.numbered_checkpoints(whole / "runs" / "quickstart" / "checkpoints")
    assert [_files.checkpoint_number(p) for p in kept] == [8, 7, 6]
    assert _weights(killed) == _weights(whole)
