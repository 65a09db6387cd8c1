"""Draw docs/figures/mixture.png: a Mixture's per-source consumption across two kills and a weight change.

Runs in one process, in a few seconds: a mixture of three sources through the package's stream loader, read
by 2 workers, killed, resumed on 3 workers with new weights, killed again, resumed without workers. Each
line is a source's cumulative samples delivered; the check at the end asserts that each source delivered
its first items in order, none lost or repeated. ``python tools/mixture_figure.py [out.png]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parent.parent
BASES = {"web": 0, "code": 10_000, "math": 20_000}
BEFORE = {"web": 0.6, "code": 0.3, "math": 0.1}
AFTER = {"web": 0.3, "code": 0.3, "math": 0.4}
BATCH = 8
# (workers, weights, batches to take before the kill; None: to the end of the epoch)
LINKS = [(2, BEFORE, 30), (3, AFTER, 65), (0, AFTER, None)]


def _loader(workers: int, weights: dict):
    from accelerate_stateful import DistContext, IterableShardDataLoader, Mixture

    sources = {name: [base + i for i in range(1000)] for name, base in BASES.items()}
    mix = Mixture(sources, weights, seed=3, on_exhausted="restart", samples_per_epoch=800)
    dl = DataLoader(mix, batch_size=BATCH, num_workers=workers, generator=torch.Generator().manual_seed(0))
    return IterableShardDataLoader.from_dataloader(dl, DistContext(0, 1))


def run() -> tuple[list[int], list[int], list[int]]:
    """The items delivered, the sample counts at the kills, and the switch point of the weight change."""
    items, kills, state, switches, killed = [], [], None, [], []
    for workers, weights, stop in LINKS:
        loader = _loader(workers, weights)
        if state is not None:
            loader.load_state_dict(state)
        killed.append(iter(loader))  # a killed process's pass never ends (a pass closed early is abandoned)
        for batch in killed[-1]:
            items += [int(i) for i in batch]
            if stop is not None and len(items) == stop * BATCH:
                break
        state = loader.state_dict()
        kills.append(len(items))
        for snapshot in state["stream"]["snapshots"] or []:
            schedule = snapshot["dataset"]["position"]["schedule"] if snapshot else []
            switches += [entry[0] for entry in schedule[1:]]
    return items, kills[:-1], sorted(set(switches))


def source_of(item: int) -> str:
    return max((base, name) for name, base in BASES.items() if item >= base)[1]


def draw(path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    items, kills, switches = run()
    for name, base in BASES.items():  # each source's first items, in order, none lost or repeated
        got = sorted(i for i in items if source_of(i) == name)
        assert got == list(range(base, base + len(got))), name
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for name in BASES:
        running, counts = 0, []
        for item in items:
            running += source_of(item) == name
            counts.append(running)
        ax.plot(range(1, len(items) + 1), counts, label=f"{name}: {BEFORE[name]:g} then {AFTER[name]:g}")
    for at, (workers, _, _) in zip(kills, LINKS[1:]):
        ax.axvline(at, color="grey", linestyle=":", linewidth=1)
        ax.text(at, ax.get_ylim()[1] * 0.97, f" killed; resumed\n on {workers} workers", fontsize=8, va="top")
    for at in switches:
        ax.axvline(at, color="black", linestyle="--", linewidth=1)
        ax.text(at, ax.get_ylim()[1] * 0.75, f" weights change from\n global sample {at}", fontsize=8)
    ax.set_xlabel("samples delivered to the training loop")
    ax.set_ylabel("samples delivered from each source")
    ax.set_title("Mixture: per-source consumption across two kills and a weight change", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    draw(sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "docs" / "figures" / "mixture.png"))
