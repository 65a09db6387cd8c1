"""Checkpoint file work against world size, ranks simulated in one process: is the cost per rank flat?

For each world size W (1 to 4,096) the benchmark saves a checkpoint as W ranks would (each rank's loader
state, then the manifest), then resumes it twice: on W ranks, and on W // 2 ranks (elastic). It counts
the files each rank opens and the ``stat`` calls it makes (``accelerate_stateful.checkpoint._files.IO``) and times
each rank's work, for two protocols:

- ``before``: what the package did until this change: every rank verifies the whole manifest (a stat of
  every file, a sha256 of every loader file) and, on an elastic resume, reads every saved rank's state;
- ``after``: the whole folder is verified by one rank, each rank opens the manifest and its own state;
  on an elastic resume the main process merges every rank's state once and sends the result.

Per-rank figures are the mean over up to 16 ranks spread over the world (the verifying or merging rank
reported on its own), so the O(W^2) protocol stays measurable at 1,024 ranks; each time is the best of 3.

    python benchmarks/bench_scale.py --out docs/figures/scale.png --json bench_out/scale.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment  # noqa: E402

from accelerate_stateful import DistContext, ShardDataLoader  # noqa: E402
from accelerate_stateful.checkpoint import _files
from accelerate_stateful.checkpoint import _resume  # noqa: E402

WORLDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
SAMPLE_RANKS = 16
BEFORE_UP_TO = 1024
BATCH = 4


def loader(rank: int, world: int, length: int, samples: Optional[list] = None) -> ShardDataLoader:
    """Rank ``rank``'s loader over ``length`` samples (``samples``: that list, shared by every simulated rank)."""
    data = DataLoader(samples if samples is not None else list(range(length)), batch_size=BATCH, shuffle=True,
                      generator=torch.Generator().manual_seed(0))
    dl = ShardDataLoader.from_dataloader(data, DistContext(rank, world))
    return dl


def save_simulated(folder: Path, world: int) -> tuple[Path, list[ShardDataLoader], dict]:
    """A checkpoint of ``world`` ranks, each after one batch: every rank's file, then the manifest."""
    checkpoint = Path(folder) / f"world_{world}"
    samples = list(range(8 * BATCH * world))  # 8 batches per rank; one list for every simulated rank
    loaders = [loader(r, world, len(samples), samples) for r in range(world)]
    entries, started = {}, time.perf_counter()
    for rank, dl in enumerate(loaders):
        next(iter(dl))
        entries.update(_files.write_encoded(checkpoint, 0, rank, _files.encode_state(dl.state_dict())))
    written = time.perf_counter()
    _files.write_manifest(checkpoint, world_size=world, num_loaders=1, hashes=entries)
    sealed = time.perf_counter()
    timing = {"write_per_rank_ms": 1e3 * (written - started) / world, "seal_ms": 1e3 * (sealed - written)}
    return checkpoint, loaders, timing


def _sampled(world: int) -> list[int]:
    step = max(1, world // SAMPLE_RANKS)
    return sorted(set(range(1, world, step)))


def _measure(work, repeats: int = 3) -> tuple[dict, float]:
    """Files opened and stat calls of one run of ``work``, and its best time of ``repeats`` in ms."""
    best = float("inf")
    for _ in range(repeats):
        _files.IO.clear()
        started = time.perf_counter()
        work()
        best = min(best, 1e3 * (time.perf_counter() - started))
    return {"files": _files.IO["open"], "stats": _files.IO["stat"]}, best


def before(checkpoint: Path, world: int, rank: int, new_world: int) -> None:
    """The previous protocol, one rank: the whole manifest verified; every rank's state read when rescaling."""
    manifest = _files.read_manifest(checkpoint)
    if new_world == world:
        _files.read_loader_state(checkpoint, 0, rank)
    else:
        for r in range(manifest["world_size"]):
            _files.read_loader_state(checkpoint, 0, r)


def after(checkpoint: Path, world: int, dl: ShardDataLoader, verifier: bool) -> None:
    """This package's protocol, for the rank of ``dl`` (the collectives carry what they carry in one process)."""
    manifest = _files.load_manifest(checkpoint)
    if verifier:
        _files.verify_files(checkpoint, manifest)
    if dl.ctx.world_size == world or dl.ctx.is_main:  # else it receives the main process's merged state
        _resume.read_states(dl.ctx, checkpoint, manifest, [dl])


def bench_world(folder: Path, world: int) -> dict:
    checkpoint, _, save = save_simulated(folder, world)
    row = {"world": world, **save}
    for label, new_world in (("same", world), ("elastic", max(1, world // 2))):
        if label == "elastic" and world == 1:
            continue
        ranks = _sampled(world) if new_world == world else _sampled(new_world)
        # The previous protocol reads O(W) files per rank: measured up to BEFORE_UP_TO (it took 7 minutes at
        # 1,024 ranks on 2 shared cores); beyond, its figures are the formula's (2W + 5 and 5W + 2 per rank).
        old = ([_measure(lambda r=r: before(checkpoint, world, r, new_world)) for r in [0] + ranks]
               if world <= BEFORE_UP_TO else [])
        samples = list(range(8 * BATCH * world))
        fresh = {r: loader(r, new_world, len(samples), samples) for r in [0] + ranks}
        new_lead = _measure(lambda: after(checkpoint, world, fresh[0], verifier=True))
        new = [_measure(lambda r=r: after(checkpoint, world, fresh[r], verifier=False)) for r in ranks]
        row[label] = {
            "before_files_per_rank": statistics.mean(m["files"] for m, _ in old) if old else None,
            "before_stats_per_rank": statistics.mean(m["stats"] for m, _ in old) if old else None,
            "before_ms_per_rank": statistics.mean(t for _, t in old) if old else None,
            "after_files_per_rank": statistics.mean(m["files"] for m, _ in new) if new else new_lead[0]["files"],
            "after_stats_per_rank": statistics.mean(m["stats"] for m, _ in new) if new else new_lead[0]["stats"],
            "after_ms_per_rank": statistics.mean(t for _, t in new) if new else new_lead[1],
            "after_verifier_files": new_lead[0]["files"],
            "after_verifier_ms": new_lead[1],
        }
    return row


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (files_ax, time_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    worlds = [r["world"] for r in rows]
    for label, style in (("same", "-"), ("elastic", "--")):
        for proto, color in (("before", "tab:red"), ("after", "tab:blue")):
            have = [r for r in rows if label in r and r[label][f"{proto}_ms_per_rank"] is not None]
            w = [r["world"] for r in have]
            files_ax.plot(w, [r[label][f"{proto}_files_per_rank"] + r[label][f"{proto}_stats_per_rank"] for r in have],
                          style, color=color, marker="o", ms=3, label=f"{proto}, resume on {'W' if label == 'same' else 'W/2'}")
            time_ax.plot(w, [r[label][f"{proto}_ms_per_rank"] for r in have], style, color=color, marker="o", ms=3,
                         label=f"{proto}, resume on {'W' if label == 'same' else 'W/2'}")
    time_ax.plot(worlds, [r["write_per_rank_ms"] for r in rows], ":", color="tab:green", marker="s", ms=3,
                 label="save: write, per rank")
    for ax, title in ((files_ax, "files opened + stat calls per rank"), (time_ax, "ms per rank (one process)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("world size W (saved)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    files_ax.legend(fontsize=8)
    time_ax.legend(fontsize=8)
    fig.suptitle("Resume cost per rank against world size (ranks simulated in one process)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def _before(cell: dict, what: str) -> str:
    """The previous protocol's files + stats or ms per rank, "-" where it was not run (beyond BEFORE_UP_TO)."""
    if cell["before_ms_per_rank"] is None:
        return "-"
    if what == "ms":
        return f"{cell['before_ms_per_rank']:.2f}"
    return f"{cell['before_files_per_rank'] + cell['before_stats_per_rank']:.0f}"


def table(rows: list[dict]) -> str:
    lines = ["| W | save: write/rank ms | seal ms | resume on W: files+stats/rank before → after | ms/rank before → after "
             "| verifier: files, ms | resume on W/2: files+stats/rank before → after | ms/rank before → after |",
             "| ---: | ---: | ---: | --- | --- | --- | --- | --- |"]
    for r in rows:
        cells = [str(r["world"]), f"{r['write_per_rank_ms']:.2f}", f"{r['seal_ms']:.1f}"]
        s = r["same"]
        cells += [f"{_before(s, 'files')} → {s['after_files_per_rank'] + s['after_stats_per_rank']:.0f}",
                  f"{_before(s, 'ms')} → {s['after_ms_per_rank']:.2f}",
                  f"{s['after_verifier_files']}, {s['after_verifier_ms']:.1f}"]
        e = r.get("elastic")
        cells += ["-", "-"] if e is None else [
            f"{_before(e, 'files')} → {e['after_files_per_rank'] + e['after_stats_per_rank']:.0f}",
            f"{_before(e, 'ms')} → {e['after_ms_per_rank']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS))
    parser.add_argument("--out", type=Path, default=Path("docs/figures/scale.png"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            rows.append(bench_world(Path(tmp), world))
            print(f"W={world}: {json.dumps(rows[-1])}", flush=True)
    plot(rows, args.out)
    print(json.dumps(environment()))
    print(table(rows))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"environment": environment(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
