"""Figures from the benchmarks' JSON results: resume time against the position, per-batch cost against bare.

``make bench`` runs it after the benchmarks::

    python benchmarks/bench_loader.py --json bench_out/loader.json
    python benchmarks/bench_stream.py --json bench_out/stream.json
    python benchmarks/plot.py bench_out docs/figures

It draws ``resume.png`` and ``per_batch.png`` from whichever of ``loader.json`` (map-style) and
``stream.json`` (iterable streams) it finds, one panel per measurement, and ``resume_readme.png``, the
README's figure: map-style data and a stream read by workers side by side, at the README's column width. Every figure carries a footer
saying which machine, which versions and when: the numbers are only true of that. No timing is taken here.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Optional

import matplotlib

matplotlib.use("Agg")  # files only, no display: also on a machine without one
import matplotlib.pyplot as plt  # noqa: E402

SOURCES = {"loader.json": "bench_loader.py", "stream.json": "bench_stream.py"}
STREAM_SMALL_STATE = "position only"  # bench_stream's A: the state of a few bytes
# Colour per family of contender, matched on the start of its name; ours is drawn on top, thicker.
COLOURS = (
    ("ours", "#1f5fbf"),
    ("accelerate_stateful", "#1f5fbf"),
    ("accelerate: skip_first_batches", "#c0392b"),
    ("StatefulDataLoader", "#e67e22"),
    ("accelerate stateful + use_seedable", "#7f8c3a"),
    ("accelerate stateful", "#27ae60"),
    ("accelerate prepare, use_stateful", "#27ae60"),
    ("accelerate prepare, plain", "#8e44ad"),
    ("DataLoader (bare)", "#555555"),
)
VERSIONS = ("python", "torch", "accelerate", "torchdata", "accelerate_stateful")


class NoResults(Exception):
    """The folder holds none of the benchmarks' JSON files."""


def load(folder: Path) -> dict:
    """``{file name: document}`` for every benchmark result found in ``folder``."""
    found = {name: json.loads((folder / name).read_text(encoding="utf-8"))
             for name in SOURCES if (folder / name).is_file()}
    if not found:
        raise NoResults(f"no benchmark results in {folder} (looked for {', '.join(SOURCES)}): run `make bench`, "
                        f"or benchmarks/bench_loader.py --json {folder}/loader.json")
    return found


def is_ours(name: str) -> bool:
    return name.startswith("ours") or "(ours)" in name


def colour(name: str) -> str:
    return next((value for prefix, value in COLOURS if name.startswith(prefix)), "#999999")


def footer(documents: dict) -> str:
    """Which machine, which versions, when, and how busy: one line per benchmark when they differ."""
    envs = {SOURCES[name]: doc["environment"] for name, doc in documents.items()}

    def machine(env: dict) -> str:
        versions = ", ".join(f"{key} {env.get(key, '?')}" for key in VERSIONS)
        return f"{env.get('cpu', '?')}, {env.get('cpu_count', '?')} cores, {env.get('platform', '?')}; {versions}"

    machines = {machine(env) for env in envs.values()}
    lines = [f"Measured on {machines.pop()}"] if len(machines) == 1 else []
    for script, env in envs.items():
        start = env.get("load average at start (1/5/15 min)", "?").split(" / ")[0]
        end = env.get("load average at end (1/5/15 min)", "?").split(" / ")[0]
        where = "" if lines else f" on {machine(env)}"
        lines.append(f"{script}: {env.get('date', '?')}{where}; load average {start} at start, {end} at end")
    lines.append("The machine was shared with other work while measuring: medians of interleaved rounds; "
                 "compare ratios, not absolute times.")
    return "\n".join(lines)


def resume_panels(documents: dict) -> list[tuple[str, list[dict]]]:
    """``(title, results)`` per measurement of the time to the first batch after a resume."""
    panels = []
    if "loader.json" in documents:
        doc = documents["loader.json"]
        samples = doc["sizes"]["resume"][0]
        panels.append((f"map-style dataset, {samples:,} samples", doc["results"]["resume"]))
    if "stream.json" in documents:
        doc = documents["stream.json"]
        for workers, results in sorted(doc["results"]["resume"].items(), key=lambda item: int(item[0])):
            items = doc["sizes"]["resume"][workers][0]
            panels.append((f"iterable stream, {items:,} items, num_workers={workers}", results))
    return panels


def per_batch_panels(documents: dict) -> list[tuple[str, list[dict]]]:
    """``(title, results)`` per measurement of the per-batch cost, each with the bare DataLoader among them."""
    panels = []
    if "loader.json" in documents:
        for workers, results in sorted(documents["loader.json"]["results"]["per_batch"].items(),
                                       key=lambda item: int(item[0])):
            panels.append((f"map-style dataset, num_workers={workers}", results))
    if "stream.json" in documents:
        for workers, by_state in sorted(documents["stream.json"]["results"]["per_batch"].items(),
                                        key=lambda item: int(item[0])):
            if STREAM_SMALL_STATE in by_state:
                panels.append((f"iterable stream, small state, num_workers={workers}", by_state[STREAM_SMALL_STATE]))
    return panels


def _figure(panels: int, title: str, size: tuple[float, float]):
    columns = min(panels, 2)  # two across stay readable at the width of a documentation page
    rows = -(-panels // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(size[0] * columns, size[1] * rows), squeeze=False,
                             layout="constrained")
    for ax in axes.flat[panels:]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=14, weight="bold")
    return fig, list(axes.flat[:panels])


def _finish(fig, documents: dict, path: Path, note: str = "") -> None:
    """The footer goes below everything; the saved image grows to hold it, however narrow the panels."""
    text = footer(documents) if not note else note + "\n" + footer(documents)
    fig.text(0.0, -0.01, text, fontsize=7.5, color="#444444", va="top", ha="left")
    fig.savefig(path, dpi=100, bbox_inches="tight", pad_inches=0.15, metadata={"Software": None})
    plt.close(fig)


def _resume_panel(ax, title: str, results: list[dict], legend: bool = True, linear: bool = False) -> None:
    ours = next((r for r in results if is_ours(r["name"])), None)
    for result in sorted(results, key=lambda r: is_ours(r["name"])):  # ours drawn last, on top
        positions = sorted(result["seconds"], key=float)
        x = [float(p) * 100 for p in positions]
        y = [result["seconds"][p] for p in positions]
        exact = result.get("exact") is not False
        label = result["name"] + ("" if exact else "  (NOT exact)")
        ax.plot(x, y, marker="o", color=colour(result["name"]), linewidth=3 if is_ours(result["name"]) else 1.6,
                markerfacecolor=colour(result["name"]) if exact else "white", label=label)
        if ours is not None and result is not ours:
            ratio = y[-1] / ours["seconds"][positions[-1]]
            ax.annotate(f"{ratio:.1f}x", (x[-1], y[-1]), textcoords="offset points", xytext=(6, 0),
                        va="center", fontsize=8, color=colour(result["name"]))
    if linear:  # the README's: a reader sees at a glance which line grows with the position
        ax.set_ylim(bottom=0)
    else:
        ax.set_yscale("log")
    ax.set_xlim(0, 105)
    ax.set_xlabel("position in the epoch where the run resumes (%)")
    ax.set_ylabel("seconds to the first batch (median)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    if legend:
        ax.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)


RATIO_NOTE = "Right of each line: its time at the last position, against ours there."


def plot_resume(documents: dict, path: Path) -> Optional[Path]:
    """Seconds to the first batch after a resume at each position of the epoch, log scale, per method."""
    panels = resume_panels(documents)
    if not panels:
        return None
    fig, axes = _figure(len(panels), "Time to the first batch after a resume, by position in the epoch", (5.4, 5.0))
    for ax, (title, results) in zip(axes, panels):
        _resume_panel(ax, title, results)
    _finish(fig, documents, path, RATIO_NOTE)
    return path


# The README's figure: drawn at the width of the README's column (800 px at 100 dpi), so that it is read at
# its own size; two panels (map-style data, a stream read by workers), one legend for both.
HEADLINE_WIDTH_IN = 8.0


# What the README's figure compares: ours against what a user has without it, stock Accelerate's
# skip_first_batches and torchdata's StatefulDataLoader (docs/benchmarks.md has every method).
HEADLINE_METHODS = ("ours", "accelerate: skip_first_batches", "StatefulDataLoader")


def headline_panels(documents: dict) -> list[tuple[str, list[dict]]]:
    panels = [(title, [r for r in results if r["name"].startswith(HEADLINE_METHODS)])
              for title, results in resume_panels(documents)]
    maps = [p for p in panels if p[0].startswith("map-style")]
    streams = [p for p in panels if p[0].startswith("iterable")]
    with_workers = [p for p in streams if not p[0].endswith("num_workers=0")]
    return maps[:1] + (with_workers or streams)[:1]


def plot_resume_headline(documents: dict, path: Path) -> Optional[Path]:
    """The resume figure at the README's column width: at most two panels side by side, a shared legend."""
    panels = headline_panels(documents)
    if not panels:
        return None
    fig = plt.figure(figsize=(HEADLINE_WIDTH_IN, 5.6), layout="constrained")
    grid = fig.add_gridspec(3, len(panels), height_ratios=[3.0, 1.0, 0.9])
    fig.suptitle("Time to the first batch after a resume", fontsize=12, weight="bold")
    labels: dict = {}
    for column, (title, results) in enumerate(panels):
        ax = fig.add_subplot(grid[0, column])
        _resume_panel(ax, title.replace(", num_workers=", ",\nnum_workers="), results, legend=False, linear=True)
        ax.set_xlabel("resume position in the epoch (%)", fontsize=9)
        ax.set_ylabel("seconds to the first batch", fontsize=9)
        for handle, label in zip(*ax.get_legend_handles_labels()):
            labels.setdefault(label, handle)
    legend = fig.add_subplot(grid[1, :])
    legend.axis("off")
    legend.legend(labels.values(), labels.keys(), loc="center", ncol=2, fontsize=8, frameon=False)
    notes = fig.add_subplot(grid[2, :])
    notes.axis("off")
    lines = [RATIO_NOTE + " Every measurement: docs/benchmarks.md."] + footer(documents).splitlines()
    text = "\n".join(textwrap.fill(line, 135, subsequent_indent="  ") for line in lines)
    notes.text(0.0, 1.0, text, fontsize=6.5, color="#444444", va="top", ha="left", transform=notes.transAxes)
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return path


def plot_per_batch(documents: dict, path: Path) -> Optional[Path]:
    """Per-batch cost of every contender as a ratio to the bare DataLoader (median over rounds)."""
    panels = per_batch_panels(documents)
    if not panels:
        return None
    fig, axes = _figure(len(panels), "Per-batch cost against a bare DataLoader (1.0 = as cheap)", (6.6, 3.2))
    for ax, (title, results) in zip(axes, panels):
        names = [r["name"] for r in results][::-1]
        ratios = [r["ratio"] for r in results][::-1]
        bars = ax.barh(names, ratios, color=[colour(n) for n in names])
        for bar, result in zip(bars, results[::-1]):
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                    f" {result['ratio']:.2f}x ({result['us_per_batch']:.0f} µs)", va="center", fontsize=8)
        ax.axvline(1.0, color="#333333", linewidth=1, linestyle="--")
        ax.set_xlim(0, max(ratios) * 1.35)
        ax.set_xlabel("µs per batch / the bare DataLoader's (median)")
        ax.set_title(title, fontsize=10)
        for label in ax.get_yticklabels():
            label.set_fontsize(8)
            label.set_weight("bold" if is_ours(label.get_text()) else "normal")
    _finish(fig, documents, path)
    return path


def main(argv: Optional[list] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    source, target = Path(args[0]), Path(args[1])
    try:
        documents = load(source)
    except NoResults as error:
        print(error, file=sys.stderr)
        return 1
    target.mkdir(parents=True, exist_ok=True)
    for written in (plot_resume(documents, target / "resume.png"), plot_per_batch(documents, target / "per_batch.png"),
                    plot_resume_headline(documents, target / "resume_readme.png")):
        if written is not None:
            print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
