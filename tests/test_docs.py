"""The documentation site: it builds strictly, documents every public name, draws its figures, and reads well
in a real browser (headless Chromium; see tools/check_site.py)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import accelerate_stateful
from scripts import ROOT, load_script

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SCREENSHOTS = ROOT / "site-check"  # documented in README.md and tools/check_site.py; git-ignored


def build(config_dir: Path, site: Path) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of the ``mkdocs.yml`` in ``config_dir`` into ``site``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=config_dir, env=env, capture_output=True, text=True, timeout=240)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def png_text(path: Path) -> dict[str, str]:
    """The PNG's text chunks (``tEXt``): where matplotlib saves ``metadata=``."""
    data, offset, found = path.read_bytes(), 8, {}
    while offset < len(data):
        length, kind = struct.unpack(">I4s", data[offset: offset + 8])
        if kind == b"tEXt":
            key, _, value = data[offset + 8: offset + 8 + length].partition(b"\0")
            found[key.decode("latin-1")] = value.decode("latin-1")
        offset += 12 + length
    return found


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    result = build(ROOT, out)
    assert result.returncode == 0, result.stdout + result.stderr
    return out


# ----------------------------------------------------------------------------- the build
def test_the_site_builds_strictly_with_the_readme_as_its_landing_page(site):
    landing = (site / "index.html").read_text(encoding="utf-8")
    assert 'id="quick-start"' in landing and "use_stateful_dataloader" in landing  # the README's quick start
    assert 'src="figures/resume_readme.png"' in landing  # the README's docs/… paths, made relative to docs/
    assert (site / "figures" / "resume_readme.png").is_file()


def test_the_api_reference_documents_every_public_name(site):
    reference = (site / "api" / "index.html").read_text(encoding="utf-8")
    missing = [name for name in accelerate_stateful.__all__ if f'id="accelerate_stateful.{name}"' not in reference]
    assert missing == []


@pytest.fixture(scope="module")
def hooks():
    return load_script("tools/docs_hooks.py", "docs_hooks")


@pytest.mark.parametrize(
    "page, problem",
    [
        pytest.param("::: accelerate_stateful.A\n", "does not document B", id="a-name-left-out"),
        pytest.param("::: accelerate_stateful.A\n::: accelerate_stateful.B\n::: accelerate_stateful.C\n",
                     "documents C, not in accelerate_stateful.__all__", id="a-name-not-public"),
        pytest.param("::: accelerate_stateful.A\n::: accelerate_stateful.B\n::: accelerate_stateful.A\n",
                     "documents A more than once", id="a-name-twice"),
    ],
)
def test_the_api_page_is_refused_unless_it_documents_exactly_the_public_names(hooks, page, problem):
    from mkdocs.exceptions import PluginError

    with pytest.raises(PluginError, match=problem):
        hooks.check_api_page(page, ["A", "B"])
    hooks.check_api_page("::: accelerate_stateful.B\n\n::: accelerate_stateful.A\n", ["A", "B"])


def test_a_docstring_example_that_markdown_reads_as_quotes_is_refused(hooks):
    import markdown
    from mkdocs.exceptions import PluginError

    session = ">>> plan = ShardPlan(num_samples=10, batch_size=2)\n>>> plan.num_batches\n5\n"
    with pytest.raises(PluginError, match="title its section 'Examples:'"):
        hooks.check_examples_render_as_code(markdown.markdown(session))  # what a section 'Example:' becomes
    hooks.check_examples_render_as_code(markdown.markdown("```python\n" + session + "```", extensions=["fenced_code"]))


def test_the_hook_reads_the_same_public_names_as_the_package(hooks):
    assert hooks.public_names(ROOT) == accelerate_stateful.__all__


def test_a_broken_link_a_broken_anchor_or_a_page_left_out_of_the_nav_fails_the_build(tmp_path):
    for name in ("mkdocs.yml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    for name in ("accelerate_stateful", "tools"):
        (tmp_path / name).symlink_to(ROOT / name)
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    with open(tmp_path / "docs" / "lifecycle.md", "a", encoding="utf-8") as handle:
        handle.write("\nSee [nowhere](no-such-page.md) and [here](exactness.md#no-such-anchor).\n")
    (tmp_path / "docs" / "orphan.md").write_text("# A page nobody added to the nav\n", encoding="utf-8")

    result = build(tmp_path, tmp_path / "site")  # strict mode reports every problem, then fails

    assert result.returncode != 0
    for problem in ("no-such-page.md", "no-such-anchor", "orphan.md"):
        assert problem in result.stdout + result.stderr


# ----------------------------------------------------------------------------- figures
def test_the_architecture_figure_names_existing_modules_and_every_module_of_the_package(tmp_path):
    drawing = load_script("tools/architecture.py", "architecture")
    package = ROOT / "accelerate_stateful"
    named = set(drawing.MODULES.values())
    modules = {path.relative_to(package).as_posix() for path in package.rglob("*.py") if path.name != "__init__.py"}

    assert sorted(named - modules) == [], "the figure names modules that do not exist: update MODULES"
    assert sorted(modules - named - set(drawing.NOT_DRAWN)) == [], "modules missing from the figure: add them"
    drawing.draw(str(tmp_path / "architecture.png"))
    assert min(png_size(tmp_path / "architecture.png")) > 300
    committed = png_text(ROOT / "docs" / "figures" / "architecture.png").get("Description")
    assert committed == drawing.fingerprint(), "docs/figures/architecture.png is stale: run `make docs`, commit it"


def test_the_lifecycle_figure_draws_exactly_the_loader_states_and_is_committed_fresh(tmp_path):
    from accelerate_stateful.loaders._passes import Phase

    drawing = load_script("tools/lifecycle_figure.py", "lifecycle_figure")
    assert sorted(drawing.STATES) == sorted(phase.value for phase in Phase), "draw every state of dl.phase"
    assert {end for edge in drawing.EDGES for end in edge[:2]} == set(drawing.STATES)
    drawing.draw(str(tmp_path / "lifecycle.png"))
    assert 600 < png_size(tmp_path / "lifecycle.png")[0] < 1000  # readable at the page's width, and small
    committed = png_text(ROOT / "docs" / "figures" / "lifecycle.png").get("Description")
    assert committed == drawing.fingerprint(), "docs/figures/lifecycle.png is stale: run `make docs`, commit it"


@pytest.fixture()
def results(tmp_path) -> Path:
    """Both benchmarks' JSON as they write it, with made-up numbers in their own result types (nothing timed)."""
    common = load_script("benchmarks/_common.py", "_common")
    loader = load_script("benchmarks/bench_loader.py", "bench_loader")
    stream = load_script("benchmarks/bench_stream.py", "bench_stream")
    fractions = {0.1: 0.01, 0.5: 0.02, 0.9: 0.03}

    def per_batch(module, names, **extra):
        return [module.PerBatchResult(name=n, num_workers=0, batches=10, us_per_batch=20.0 + i,
                                      best_us_per_batch=19.0, first_batch_ms=1.0, ratio=1 + i / 10, **extra)
                for i, n in enumerate(names)]

    def resume(module, names, **extra):
        return [module.ResumeResult(name=n, seconds={f: t * (i + 1) for f, t in fractions.items()}, best=fractions,
                                    exact=i != 1, position_s=None, **extra) for i, n in enumerate(names)]

    env = {**common.environment(), "load average at end (1/5/15 min)": "1.00 / 1.00 / 1.00"}
    documents = {
        "loader.json": {"per_batch": {0: per_batch(loader, loader.PER_BATCH_CONTENDERS)},
                        "resume": resume(loader, loader.RESUME_CONTENDERS)},
        "stream.json": {
            "per_batch": {0: {stream.SMALL.label: per_batch(
                stream, stream.PER_BATCH_CONTENDERS, state=stream.SMALL.label, main_cpu_us=1.0, worker_cpu_us=0.0)}},
            "resume": {2: resume(stream, stream.RESUME_CONTENDERS, num_workers=2)},
        },
    }
    sizes = {"loader.json": loader.FULL_SIZES, "stream.json": stream.FULL_SIZES}
    for name, data in documents.items():
        document = {"environment": env, "sizes": sizes[name], "results": data}
        (tmp_path / name).write_text(json.dumps(common.jsonable(document)), encoding="utf-8")
    return tmp_path


def test_plot_draws_both_figures_from_the_benchmark_results_with_machine_and_versions(results, tmp_path):
    plot = load_script("benchmarks/plot.py", "plot")
    out = tmp_path / "figures"

    assert plot.main([str(results), str(out)]) == 0

    assert min(png_size(out / "resume.png")) > 300 and min(png_size(out / "per_batch.png")) > 300
    footer = plot.footer(plot.load(results))
    env = json.loads((results / "loader.json").read_text(encoding="utf-8"))["environment"]
    for fact in ("cpu", "cpu_count", "python", "torch", "accelerate", "torchdata", "date"):
        assert str(env[fact]) in footer
    assert [title for title, _ in plot.resume_panels(plot.load(results))] == [
        "map-style dataset, 1,000,000 samples", "iterable stream, 200,000 items, num_workers=2"]


def test_plot_says_what_to_run_when_there_are_no_results(tmp_path, capsys):
    plot = load_script("benchmarks/plot.py", "plot")
    assert plot.main([str(tmp_path), str(tmp_path / "figures")]) == 1
    assert "run `make bench`" in capsys.readouterr().err
    assert not (tmp_path / "figures").exists()


# ----------------------------------------------------------------------------- in a browser
@pytest.fixture(scope="module")
def browser():
    """The check script and a Chromium binary; skipped only where none could be installed (and said why)."""
    check = load_script("tools/check_site.py", "check_site")
    binary = check.find_browser()
    if binary is None:
        reason = os.environ.get("DOCS_BROWSER_UNAVAILABLE")
        if reason:
            pytest.skip(f"no Chromium: {reason}")
        if os.environ.get("CI"):
            pytest.fail("no Chromium in CI: .ci/run installs it with apt-get (or says why it could not)")
        pytest.skip("no Chromium on this machine: apt-get install -y chromium, or set CHROMIUM=/path/to/it")
    return check, binary


@pytest.mark.timeout(180)
def test_every_page_renders_in_chromium_with_its_figures_and_no_console_error(site, browser):
    check, binary = browser
    reports = check.check_site(site, SCREENSHOTS, binary)

    assert {r.url.split("/", 3)[3]: r.problems for r in reports if r.problems} == {}
    assert len(reports) == len(check.pages(site)) >= 15
    figures = {r.url.split("/", 3)[3]: r.images for r in reports}
    assert figures[""] >= 1 and figures["benchmarks/"] >= 2 and figures["architecture/"] >= 1
    for shot in ("landing.png", "benchmarks.png"):
        assert png_size(SCREENSHOTS / shot)[0] == check.VIEWPORT[0]


@pytest.mark.timeout(120)
def test_the_browser_check_reports_a_missing_figure_a_console_error_and_an_exception(tmp_path, browser):
    check, binary = browser
    (tmp_path / "index.html").write_text("<html><body><article><h1>Fine</h1><p>Enough text to count as a page."
                                         "</p></article></body></html>", encoding="utf-8")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "index.html").write_text(
        "<html><body><article><h1>Broken</h1><p>A page with a missing figure and failing scripts.</p>"
        '<img src="missing.png"><script>console.error("boom"); null.nothing;</script></article></body></html>',
        encoding="utf-8")

    reports = {r.url.split("/", 3)[3]: r.problems for r in check.check_site(tmp_path, tmp_path / "shots", binary)}

    assert reports[""] == []
    problems = "\n".join(reports["broken/"])
    assert "figure did not load" in problems and "missing.png" in problems
    assert "console.error: boom" in problems
    assert "uncaught: TypeError" in problems
    assert "HTTP 404" in problems


def test_the_browsers_own_favicon_request_is_no_problem_of_the_page_but_the_pages_requests_are():
    # Chromium fetches /favicon.ico by itself for a page that declares no icon, at a moment of its choosing: in CI
    # it once arrived before the check read the landing page's events and failed a page that asked for nothing.
    check = load_script("tools/check_site.py", "check_site")
    def missing(url: str) -> list[dict]:
        return [{"method": "Network.responseReceived", "params": {"response": {"status": 404, "url": url}}},
                {"method": "Log.entryAdded", "params": {"entry": {"level": "error", "source": "network", "url": url,
                                                                  "text": "Failed to load resource: 404"}}}]
    assert check._problems_in(missing("http://127.0.0.1:8000/favicon.ico")) == []
    assert len(check._problems_in(missing("http://127.0.0.1:8000/figures/loss.png"))) == 2
    assert len(check._problems_in(missing("http://127.0.0.1:8000/api/favicon.ico.png"))) == 2
