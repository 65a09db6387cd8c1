"""docs/compatibility.md says exactly which tests run at the floor and newest releases (``noxfile.FAST_SUBSET``).

Issue 26: it said "what setup.py admits is what is tested" while the floor session ran 8 of ~100 test files.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGE = (REPO / "docs" / "compatibility.md").read_text(encoding="utf-8")


def _fast_subset() -> list[str]:
    tree = ast.parse((REPO / "noxfile.py").read_text(encoding="utf-8"))
    found = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                 and getattr(node.targets[0], "id", None) == "FAST_SUBSET")
    return [Path(item).name for item in ast.literal_eval(found)]


def test_the_compatibility_page_names_every_file_the_floor_runs_and_how_many():
    files = _fast_subset()
    session = PAGE[PAGE.index("- `nox -s floor`"):PAGE.index("- `nox -s newest`")]
    named = re.findall(r"`(?:tests/)?(test_\w+\.py)`", session)
    assert sorted(named) == sorted(files)
    assert f"these {len(files)} files and no others" in session
    assert f"{len(files)} of the suite's ~100 test files" in PAGE


def test_the_compatibility_page_does_not_claim_the_whole_suite_runs_at_the_floor():
    assert "admits is what is tested" not in PAGE
    assert "is tested on the pinned set only" in " ".join(PAGE.split())
