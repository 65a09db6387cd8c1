"""Draws docs/figures/lifecycle.png: a loader's four states and the events that move it between them.

``make docs`` runs it. The states are the values of ``accelerate_stateful.loaders._passes.Phase`` (what
``dl.phase`` answers); ``tests/test_docs.py`` checks that :data:`STATES` names exactly those, and that the
committed PNG shows what this script draws (its :func:`fingerprint` is saved in the PNG).

Usage::

    python tools/lifecycle_figure.py docs/figures/lifecycle.png
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass

OPEN, REST, NOTE = "#dbe9f6", "#e3f1df", "#f2f2f2"
EVENT, VERDICT, LOAD = "#333333", "#8a5a00", "#a23b2a"


@dataclass(frozen=True)
class State:
    """A state's box: its centre, width, name (a ``Phase`` value) and what ``state_dict()`` records there."""

    x: float
    y: float
    w: float
    name: str
    says: str
    color: str = REST


STATES = {
    "not started": State(15, 30, 26, "not started", "start of dl.epoch"),
    "iterating": State(60, 56, 36, "iterating", "an open pass: after its last batch taken;\n"
                       "load_state_dict() refused while it is held", OPEN),
    "exhausted": State(105, 30, 28, "exhausted", "start of dl.epoch (the next)"),
    "restored": State(60, 6, 30, "restored", "the restored position"),
}

BEND = 0.18
# (from, to, label, kind, where, bend): kind "event" (solid), "verdict" (dashed: the end of a pass, judged at
# an event every rank shares) or "load" (the checkpoint's calls); the label sits ``where`` along the edge, an
# arc bent ``bend`` (a fraction of its length) to its left, so two edges between two states never overlap.
EDGES = [
    ("not started", "iterating", "iter()", "event", 0.5, BEND),
    ("restored", "iterating", "iter()", "event", 0.3, BEND),
    ("exhausted", "iterating", "iter():\nthe next epoch", "event", 0.5, BEND),
    ("iterating", "exhausted", "exhaustion (asked past the last batch),\nor let go trained: the epoch ends\n"
     "(let go untrained, begun here: undone)", "verdict", 0.45, BEND),
    ("iterating", "not started", "let go untrained:\nundone", "verdict", 0.5, BEND),
    ("iterating", "restored", "undone", "verdict", 0.3, BEND),
    ("not started", "restored", "load_state_dict(),\nskip_first_batches()", "load", 0.5, BEND),
    ("exhausted", "restored", "load_state_dict(),\nskip_first_batches()", "load", 0.5, -BEND),
    ("exhausted", "not started", "set_epoch(e)", "event", 0.35, -0.15),
    ("restored", "not started", "set_epoch(e)", "event", 0.55, BEND),
]
BOX_H = 8.5


def fingerprint() -> str:
    """What the figure says (every state and edge), hashed: saved in the PNG to tell a stale one."""
    said = [[s.name, s.says] for s in STATES.values()] + [list(edge) for edge in EDGES]
    return hashlib.sha256(json.dumps(said).encode()).hexdigest()[:16]


def draw(path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    fig, ax = plt.subplots(figsize=(10.4, 7))
    ax.set_xlim(0, 120)
    ax.set_ylim(-8, 72)
    ax.set_aspect("equal")
    ax.axis("off")
    patches = {}
    for state in STATES.values():
        patch = FancyBboxPatch((state.x - state.w / 2, state.y - BOX_H / 2), state.w, BOX_H,
                               boxstyle="round,pad=0.4,rounding_size=1.2", facecolor=state.color,
                               edgecolor="#555555", linewidth=1.2, zorder=2)
        ax.add_patch(patch)
        patches[state.name] = patch
        lines = state.says.count("\n")
        ax.text(state.x, state.y + 1.4 + 0.8 * lines, state.name, ha="center", va="center", fontsize=11,
                weight="bold", zorder=3)
        ax.text(state.x, state.y - 1.6, state.says, ha="center", va="center", fontsize=7.5, color="#333333",
                zorder=3, linespacing=1.1)
    for start, end, label, kind, where, bend in EDGES:
        a, b = STATES[start], STATES[end]
        color = {"event": EVENT, "verdict": VERDICT, "load": LOAD}[kind]
        ax.add_patch(FancyArrowPatch((a.x, a.y), (b.x, b.y), patchA=patches[start], patchB=patches[end],
                                     connectionstyle=f"arc3,rad={bend}", arrowstyle="-|>", mutation_scale=13,
                                     linestyle="--" if kind == "verdict" else "-", color=color, linewidth=1.2,
                                     shrinkA=3, shrinkB=3, zorder=1))
        ax.text(*_along(a, b, where, bend), label, ha="center", va="center", fontsize=8, color=color, zorder=4,
                linespacing=1.1,
                bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none"})
    top = STATES["iterating"]
    ax.add_patch(FancyArrowPatch((top.x - 6, top.y + BOX_H / 2 + 0.6), (top.x + 6, top.y + BOX_H / 2 + 0.6),
                                 connectionstyle="arc3,rad=-0.9", arrowstyle="-|>", mutation_scale=11,
                                 color=EVENT, linewidth=1.1))
    ax.text(top.x + 9, top.y + BOX_H / 2 + 4.5, "save_state(), any query: no state change", ha="left", va="center",
            fontsize=8, color=EVENT)
    ax.text(60, -5.5, "dashed: a pass ends. One the loop let go (break, zip, a peek) stays open until the next event "
            "every rank shares\n(iter(), set_epoch, it.close(), save_state/load_state), which judges it; "
            "undone = back to the state it began in", ha="center", va="center", fontsize=7.5, color="#444444",
            linespacing=1.3)
    fig.savefig(path, dpi=100, bbox_inches="tight", pad_inches=0.05,
                metadata={"Software": None, "Description": fingerprint()})
    plt.close(fig)


def _along(a: State, b: State, t: float, bend: float) -> tuple[float, float]:
    """The point ``t`` of the way along the arc from ``a`` to ``b`` (matplotlib's arc3: a quadratic Bezier whose
    control point stands ``bend`` times the chord's length off the chord's middle)."""
    dx, dy = b.x - a.x, b.y - a.y
    cx, cy = (a.x + b.x) / 2 + bend * dy, (a.y + b.y) / 2 - bend * dx
    u = 1 - t
    return u * u * a.x + 2 * t * u * cx + t * t * b.x, u * u * a.y + 2 * t * u * cy + t * t * b.y


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    draw(sys.argv[1])
