"""MkDocs hooks (``mkdocs.yml``: ``hooks:``): the README is the landing page; the API page misses no public name.

- ``index.md`` is made from ``README.md`` at every build, its ``docs/…`` links made relative to ``docs/``,
  so the quick start has one copy, the README's. A link in the README to a file outside ``docs/`` is left as
  it is, and the strict build refuses it as a broken link.
- ``api.md`` must hold one ``::: accelerate_stateful.NAME`` for every name in ``accelerate_stateful.__all__``
  and none for anything else; the build fails otherwise, naming the names, so a new public name cannot be
  left out of the reference. An example in a docstring must render as code: a ``>>>`` session under a
  section Google style does not know as examples (``Example:``) renders as nested quotes, and fails the build.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

PACKAGE = "accelerate_stateful"
API_PAGE = "api.md"
_DIRECTIVE = re.compile(rf"^:::\s+{PACKAGE}\.(\w+)\s*$", re.MULTILINE)
_DOCS_LINK = re.compile(r"\]\(docs/")
_PROSE_DOCTEST = re.compile(r"<blockquote>\s*<blockquote>\s*<blockquote>")  # ">>> " read as Markdown quotes


def _root(config) -> Path:
    return Path(config.config_file_path).resolve().parent


def public_names(root: Path) -> list[str]:
    """``__all__`` of the package, read from its ``__init__.py`` without importing it (nor torch)."""
    tree = ast.parse((root / PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise PluginError(f"{PACKAGE}/__init__.py has no __all__: the API reference is built from it")


def landing_page(readme: str) -> str:
    """The README with its links into ``docs/`` made relative to ``docs/``, where ``index.md`` lives."""
    return _DOCS_LINK.sub("](", readme)


def check_api_page(markdown: str, names: list[str]) -> None:
    """Refuse an API page that leaves out a public name, names one twice, or documents a non-public name."""
    documented = _DIRECTIVE.findall(markdown)
    missing = sorted(set(names) - set(documented))
    extra = sorted(set(documented) - set(names))
    twice = sorted({name for name in documented if documented.count(name) > 1})
    problems = []
    if missing:
        problems.append(f"it does not document {', '.join(missing)} (add `::: {PACKAGE}.NAME` under the section "
                        "it belongs to)")
    if extra:
        problems.append(f"it documents {', '.join(extra)}, not in {PACKAGE}.__all__ (remove them, or export them)")
    if twice:
        problems.append(f"it documents {', '.join(twice)} more than once")
    if problems:
        raise PluginError(f"docs/{API_PAGE}: " + "; ".join(problems))


def check_examples_render_as_code(html: str) -> None:
    """Refuse a page where a docstring's ``>>>`` example came out as prose instead of code."""
    match = _PROSE_DOCTEST.search(html)
    if match:
        text = re.sub(r"<[^>]+>", " ", html[match.end(): match.end() + 300]).split()
        raise PluginError(f"docs/{API_PAGE}: a docstring example renders as quoted prose ({' '.join(text[:12])} …): "
                          "title its section 'Examples:' (Google style), not 'Example:'")


def on_files(files, config):
    if files.get_file_from_path("index.md") is not None:
        raise PluginError("docs/index.md would replace the landing page made from README.md: remove it and edit "
                          "README.md instead")
    readme = (_root(config) / "README.md").read_text(encoding="utf-8")
    files.append(File.generated(config, "index.md", content=landing_page(readme)))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == API_PAGE:
        check_api_page(markdown, public_names(_root(config)))
    return markdown


def on_page_content(html, page, config, files):
    if page.file.src_uri == API_PAGE:
        check_examples_render_as_code(html)
    return html
