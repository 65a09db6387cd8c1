"""Every ```python block in README.md and docs/ runs as written, or is a named fragment of a complete file.

The blocks are read by pytest-codeblocks (``extract_from_file``), and a block is left out of the run by that
tool's own mark, one HTML comment (invisible on the site) on the line above its fence::

    A fragment of `examples/quickstart.py`:

    <!--pytest.mark.skip(reason="fragment of examples/quickstart.py")-->

The page says so in words just above, and every line of the fragment is in the named file, in order
(comments aside). No other
mark is accepted: a block is either run here or is such a fragment. A runnable block runs in a folder of its own
(tmp_path), with a fresh Accelerate state, as the ``__main__`` module; each runs in a few seconds on a CPU.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pytest_codeblocks import extract_from_file

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FRAGMENT = re.compile(r'pytest\.mark\.skip\(reason="fragment of (?P<path>[\w./-]+)"\)')
# Languages a reader would take for Python: name them ``python`` so that the block runs here.
PYTHON_ALIASES = {"py", "python3", "pycon", "ipython"}


def _python_blocks() -> list:
    return [(page, block) for page in PAGES for block in extract_from_file(page)
            if block.syntax == "python" or block.syntax in PYTHON_ALIASES]


BLOCKS = _python_blocks()


def _where(page: Path, block) -> str:
    return f"{page.relative_to(ROOT).as_posix()}:{block.lineno}"


def _name(page: Path, block) -> str:
    return re.sub(r"\W+", "_", _where(page, block).lower())


def test_every_python_block_is_run_or_marked_as_a_named_fragment():
    assert len(BLOCKS) >= 20, "the blocks were not found: has pytest-codeblocks changed how it reads a page?"
    wrong = {_where(page, block): block.syntax for page, block in BLOCKS if block.syntax != "python"}
    assert wrong == {}, "write ```python so that the block runs here"
    unknown = {_where(page, block): block.marks for page, block in BLOCKS
               if block.marks and (len(block.marks) != 1 or not FRAGMENT.fullmatch(block.marks[0]))}
    assert unknown == {}, 'the only mark is <!--pytest.mark.skip(reason="fragment of path/to/file.py")-->'


def _runs_as_written(page: Path, block):
    def test(tmp_path, monkeypatch, fresh_accelerate_state):
        monkeypatch.chdir(tmp_path)
        exec(compile(block.code, _where(page, block), "exec"), {"__name__": "__main__"})

    return test


def _paragraph_above(page: Path, block) -> str:
    """The paragraph just above the block's fence (past the mark's comment), as one line."""
    lines = page.read_text(encoding="utf-8").splitlines()[: block.lineno - 1]
    while lines and (not lines[-1].strip() or lines[-1].lstrip().startswith("<!--")):
        lines.pop()
    paragraph = []
    while lines and lines[-1].strip():
        paragraph.insert(0, lines.pop().strip())
    return " ".join(paragraph)


def _code_lines(text: str) -> list:
    """The code of each line, stripped, without its comment (a page may comment a line the file does not)."""
    code = (re.sub(r"(^|\s+)#.*$", "", line).strip() for line in text.splitlines())
    return [line for line in code if line and line != "..."]


def _check_fragment(page: Path, block) -> None:
    named = FRAGMENT.fullmatch(block.marks[0])["path"]
    source = ROOT / named
    assert source.is_file(), f"{_where(page, block)} is a fragment of {named}, which does not exist"
    assert f"fragment of `{named}`" in _paragraph_above(page, block).lower(), (
        f"say in the paragraph above {_where(page, block)}: A fragment of `{named}`")
    wanted, found = _code_lines(block.code), iter(_code_lines(source.read_text(encoding="utf-8")))
    missing = [line for line in wanted if not any(line == have for have in found)]
    assert missing == [], f"{_where(page, block)}: these lines are not in {named} (in this order)"


# One named test per block (not a parametrized grid: tests/conftest.py runs a sample of those), e.g.
# test_the_block_runs_as_written__docs_dcp_md_8.
for _page, _block in BLOCKS:
    if _block.marks:
        globals()[f"test_a_fragment_is_in_the_file_it_names__{_name(_page, _block)}"] = (
            lambda page=_page, block=_block: _check_fragment(page, block))
    else:
        globals()[f"test_the_block_runs_as_written__{_name(_page, _block)}"] = _runs_as_written(_page, _block)


def test_the_trainer_page_gives_the_transformers_floor_of_setup_py():
    floor = re.search(r'"transformers>=([\d.]+),', (ROOT / "setup.py").read_text(encoding="utf-8"))[1]
    assert f"transformers ≥ {floor}," in (ROOT / "docs" / "trainer.md").read_text(encoding="utf-8")
