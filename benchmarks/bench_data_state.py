"""The data state per rank up to 4,096 ranks (simulated in one process), and what in it grows (issue 28 §5.2).

For each world size W and each pipeline, the benchmark builds the loader of a few ranks spread over the
world (rank 0, the middle one, the last), takes one batch, and saves that rank's state as the package does
(``_files.encode_state`` + ``write_encoded``: the files of one rank), then reads it back into a fresh loader of
that rank. Against it: torchdata's ``StatefulDataLoader`` over the same dataset, its ``state_dict()`` saved as one
``torch.save`` file per rank and loaded back. Per rank: bytes written, save and load milliseconds (best of 3),
files written and read. The files each rank opens at a resume on W and on W // 2 ranks, with every rank's
files present, are ``bench_scale.py``'s measurement (map-style states: the protocol does not look inside them).

Pipelines (``batch_size=2``):

- ``map``: a list of ``8 * 2 * W`` ints, ``shuffle=True`` (``ShardDataLoader``; ``StatefulDataLoader`` with a
  ``DistributedSampler`` of that rank);
- ``lm``: ``Packed(Mixture({web, code, math: Shuffled(docs, buffer_size=B)}), seq_len=128)`` (the package's
  ``IterableShardDataLoader``: every rank reads the global sequence and keeps its share; ``StatefulDataLoader``
  with ``num_workers=0`` reads the whole sequence, as it does not split a stream by rank).

The last table takes the ``lm`` state of one rank apart: bytes of each part, for B = 1,000 and 10,000.

    python benchmarks/bench_data_state.py                    # about 4 minutes on 2 loaded cores
    python benchmarks/bench_data_state.py --worlds 1 16 --buffer 100   # seconds
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch.utils.data import DataLoader, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, table  # noqa: E402

from accelerate_stateful import DistContext, IterableShardDataLoader, ShardDataLoader  # noqa: E402
from accelerate_stateful.checkpoint import _files  # noqa: E402
from accelerate_stateful.sources import Mixture, Packed, Shuffled  # noqa: E402

WORLDS = (1, 16, 256, 1024, 4096)
BATCH, SEQ_LEN = 2, 128
WEIGHTS = {"web": 0.6, "code": 0.3, "math": 0.1}


def documents(count: int, seed: int = 0) -> dict[str, list[dict]]:
    """Tokenized documents of 8 to 56 tokens per source, enough for ``count`` documents drawn in all."""
    rng = random.Random(seed)
    return {name: [{"input_ids": [rng.randrange(200) for _ in range(rng.randint(8, 56))]}
                   for _ in range(int(count * weight) + 64)] for name, weight in WEIGHTS.items()}


def lm_pipeline(docs: dict, buffer_size: int) -> Packed:
    shuffled = {name: Shuffled(rows, buffer_size=buffer_size, seed=1) for name, rows in docs.items()}
    return Packed(Mixture(shuffled, WEIGHTS, seed=0), SEQ_LEN)


def _rows_needed(world: int, buffer_size: int) -> int:
    """Documents a rank of ``world`` reads for its first batch: ``world * BATCH`` rows of about 4 documents,
    each source's buffer filled first, with a margin."""
    return 8 * BATCH * world + 4 * buffer_size + 1024


# --------------------------------------------------------------------------- loaders of one simulated rank
def ours(pipeline: str, rank: int, world: int, data: Any) -> Any:
    if pipeline == "map":
        base = DataLoader(data, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0))
        return ShardDataLoader.from_dataloader(base, DistContext(rank, world))
    base = DataLoader(data, batch_size=BATCH, drop_last=pipeline.endswith("drop_last"))
    return IterableShardDataLoader.from_dataloader(base, DistContext(rank, world))


def torchdata(pipeline: str, rank: int, world: int, data: Any) -> StatefulDataLoader:
    if pipeline == "map":
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
        return StatefulDataLoader(data, batch_size=BATCH, sampler=sampler)
    return StatefulDataLoader(data, batch_size=BATCH)


def _best_ms(work: Callable[[], Any], repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        best = min(best, 1e3 * (time.perf_counter() - started))
    return best


def measure_ours(folder: Path, make: Callable[[], Any], rank: int) -> dict:
    """One rank: its state after one batch saved as the package saves it, then loaded into a fresh loader."""
    loader = make()
    next(iter(loader))
    written: dict = {}

    def save() -> None:
        written.clear()
        written.update(_files.write_encoded(folder, 0, rank, _files.encode_state(loader.state_dict())))

    save_ms = _best_ms(save)
    _files.IO.clear()
    _files.read_loader_state(folder, 0, rank)
    opened = _files.IO["open"]
    load_ms = _best_ms(lambda: make().load_state_dict(_files.read_loader_state(folder, 0, rank)))
    size = sum((folder / name).stat().st_size for name in written)
    return {"bytes": size, "save_ms": save_ms, "load_ms": load_ms, "files_written": len(written),
            "files_read": opened}


def measure_torchdata(folder: Path, make: Callable[[], Any], rank: int) -> dict:
    """One rank: ``torch.save(loader.state_dict())`` into its own file, then ``torch.load`` into a fresh one."""
    loader = make()
    next(iter(loader))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"dl_state_rank{rank}.pt"
    save_ms = _best_ms(lambda: torch.save(loader.state_dict(), path))
    load_ms = _best_ms(lambda: make().load_state_dict(torch.load(path, weights_only=False)))
    return {"bytes": path.stat().st_size, "save_ms": save_ms, "load_ms": load_ms, "files_written": 1,
            "files_read": 1}


def bench_world(folder: Path, world: int, buffer_size: int) -> dict:
    """Mean over the sampled ranks of every figure, per pipeline and loader."""
    ranks = sorted({0, world // 2, world - 1})
    lm = lm_pipeline(documents(_rows_needed(world, buffer_size)), buffer_size)
    datasets = {"map": list(range(8 * BATCH * world)), "lm": lm, "lm, drop_last": lm}
    row: dict = {"world": world}
    for pipeline, data in datasets.items():
        for name, build, measure in (("ours", ours, measure_ours), ("torchdata", torchdata, measure_torchdata)):
            if pipeline == "lm, drop_last" and name == "torchdata":
                continue  # the same state as without: drop_last changes nothing in torchdata's
            figures = [measure(folder / f"{pipeline}_{name}_{world}", lambda r=r: build(pipeline, r, world, data), r)
                       for r in ranks]
            row[f"{pipeline}/{name}"] = {key: sum(f[key] for f in figures) / len(figures) for key in figures[0]}
    return row


# --------------------------------------------------------------------------- what in the state grows
def parts(state: Any, path: str = "") -> list[tuple[str, int]]:
    """(path, bytes of its JSON) of the deepest dict entries over 200 bytes (a list is one entry, but for a
    list of one dict: the snapshot of the one worker, taken apart)."""
    found: list[tuple[str, int]] = []
    if isinstance(state, dict):
        for key, value in state.items():
            found += parts(value, f"{path}/{key}")
    elif isinstance(state, list) and len(state) == 1 and isinstance(state[0], dict):  # one worker's snapshot
        found += parts(state[0], f"{path}[0]")
    found = [(p, s) for p, s in found if s > 200]
    if path and not found:
        found.append((path, len(json.dumps(state, default=str))))
    return found


def state_parts(buffer_size: int, world: int = 16) -> dict:
    """The ``lm`` state of the last rank of ``world`` after one batch, taken apart."""
    data = lm_pipeline(documents(_rows_needed(world, buffer_size)), buffer_size)
    loader = ours("lm", world - 1, world, data)
    next(iter(loader))
    state = loader.state_dict()
    big = sorted(parts(state), key=lambda p: -p[1])[:8]
    return {"buffer_size": buffer_size, "world": world, "json_bytes": len(json.dumps(state, default=str)),
            "parts": big}


# --------------------------------------------------------------------------- report
def state_table(rows: list[dict]) -> str:
    header = ["W", "pipeline", "loader", "bytes / rank", "save ms / rank", "load ms / rank", "files written / rank",
              "files read / rank"]
    out = []
    for r in rows:
        for key in (k for k in r if "/" in k):
            f, (pipeline, name) = r[key], key.split("/")
            out.append([f"{r['world']:,}", pipeline, name, f"{f['bytes']:,.0f}", f"{f['save_ms']:.2f}",
                        f"{f['load_ms']:.2f}", f"{f['files_written']:.0f}", f"{f['files_read']:.0f}"])
    return "\n".join(table(header, out))


def parts_table(found: Sequence[dict]) -> str:
    out = [[f"{p['world']:,}", f"{p['buffer_size']:,}", f"{p['json_bytes']:,}", path, f"{size:,}"]
           for p in found for path, size in p["parts"]]
    return "\n".join(table(["W", "buffer_size", "state (JSON bytes)", "part", "JSON bytes"], out))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS))
    parser.add_argument("--buffer", type=int, default=10_000, help="each source's shuffle buffer in the lm pipeline")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    started, rows = time.perf_counter(), []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            rows.append(bench_world(Path(tmp), world, args.buffer))
            print(f"[{time.perf_counter() - started:5.0f} s] W={world}: {json.dumps(rows[-1])}", flush=True)
    found = [state_parts(size, world) for size in sorted({min(1_000, args.buffer), args.buffer})
             for world in sorted({1, min(args.worlds[-1], 256)})]
    env = environment()
    env["benchmark wall time (s)"] = f"{time.perf_counter() - started:.0f}"
    print(json.dumps(env))
    print(state_table(rows))
    print()
    print(parts_table(found))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"environment": env, "rows": rows, "parts": found}, indent=1))


if __name__ == "__main__":
    main()
