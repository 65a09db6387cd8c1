"""The package layout: every concept in its sub-package, and no import cycle between modules."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import accelerate_stateful

PACKAGE_DIR = Path(accelerate_stateful.__file__).parent
NAME = "accelerate_stateful"


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module of the package that ``module`` imports, at module level or inside functions.

    ``from pkg import name`` points at ``pkg.name`` when that is a module, else at ``pkg`` itself;
    imports under ``if TYPE_CHECKING:`` run at no time and are left out.
    """
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    edges: set[str] = set()
    skipped: set[int] = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            skipped.update(id(child) for child in ast.walk(node))
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            edges.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                target = f"{source}.{alias.name}"
                if target in modules:
                    edges.add(target)
                elif source in modules:
                    edges.add(source)
    edges.discard(module)
    return edges


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    # The package's own __init__ imports everything to re-export it: edges into it would be cycles by design
    # of the front door, so a module importing the top-level package is reported by its own test below.
    return {name: _imports(name, path, modules) - {NAME} for name, path in modules.items()}


def test_no_module_imports_another_that_imports_it_back():
    assert _cycles(_graph()) == []


def test_no_module_inside_the_package_imports_the_public_front_door():
    modules = _modules()
    offenders = sorted(name for name, path in modules.items() if name != NAME and NAME in _imports(name, path, modules))
    assert offenders == []


def test_cycle_finder_reports_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize(
    "subpackage, concept",
    [
        pytest.param("loaders", "the prepared loaders and their lifecycle", id="loaders"),
        pytest.param("sources", "logical shards and round-robin sources", id="sources"),
        pytest.param("position", "pure order and position arithmetic", id="position"),
        pytest.param("training", "what the training run carries besides positions", id="training"),
        pytest.param("checkpoint", "loader state, files, manifest", id="checkpoint"),
        pytest.param("integrations", "Trainer and TRL", id="integrations"),
        pytest.param("cli", "the command-line tool", id="cli"),
    ],
)
def test_each_concept_has_one_documented_subpackage(subpackage, concept):
    module = importlib.import_module(f"{NAME}.{subpackage}")
    assert module.__doc__ and module.__doc__.strip(), f"{subpackage} ({concept}) needs a docstring saying what it holds"


def test_the_flat_folder_keeps_only_the_front_door_and_cross_cutting_modules():
    top = sorted(p.stem for p in PACKAGE_DIR.glob("*.py"))
    assert top == ["__init__", "__main__", "_context", "_log", "_teardown", "accelerator", "errors", "transformers"]
