"""What a checkpoint says, as a stable JSON-able report (``inspect --json``; fields in ``docs/cli.md``).

Read from the files alone, without torch (``_position`` for where a map-style loader stands).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ..checkpoint import _files
from ..checkpoint import _state as S
from ._carry import carry_line, describe_carry
from ._position import KINDS, is_map_style, map_position, with_reader
from ._read import Checkpoint, UnreadableCheckpoint
from ..errors import StatefulLoaderError
from ..sources._merge import merge_positions
from ..sources._mixture_state import source_counts
from ..position._saved import striped_settings

SCHEMA_VERSION = 1
_LOGICAL = {"positions", "done", "next"}  # the keys of a LogicalShardStream's state


def describe(ckpt: Checkpoint) -> dict:
    """The report of a checkpoint: completeness and why, versions, topology, every loader on every rank."""
    manifest = ckpt.manifest or {}
    return {
        "schema_version": SCHEMA_VERSION,
        "checkpoint": str(ckpt.path),
        "complete": ckpt.complete,
        "problems": [{"file": p.file, "message": p.message} for p in ckpt.problems],
        "manifest_version": manifest.get("manifest_version"),
        "manifest_problem": _manifest_problem(ckpt),
        "world_size": ckpt.world_size,
        "num_loaders": ckpt.num_loaders,
        "loaders": [_loader(ckpt, index) for index in range(ckpt.num_loaders)],
        "gradient_carry": describe_carry(ckpt.path, ckpt.manifest),
    }


def _manifest_problem(ckpt: Checkpoint) -> Optional[str]:
    """``None`` with a readable manifest; else ``"missing"`` or ``"damaged"``."""
    if ckpt.manifest is not None:
        return None
    return "damaged" if (ckpt.path / _files.SUBDIR / _files.MANIFEST).exists() else "missing"


def _loader(ckpt: Checkpoint, index: int) -> dict:
    states = [ckpt.states.get((index, rank)) for rank in range(ckpt.world_size)]
    present = [s for s in states if s is not None]
    first = present[0] if present else None
    reader = _reader_state(states)
    return {
        "loader": index,
        "kind": KINDS[first[S.MODE]] if first else None,
        "reads": KINDS.get(reader[S.MODE]) if reader is not None else None,
        "format_version": first[S.VERSION] if first else None,
        "config": dict(first[S.CONFIG]) if first else None,
        "ranks": [_rank(ckpt, index, states, rank) for rank, s in enumerate(states) if s is not None],
    }


def _reader_state(states: list) -> Optional[Mapping[str, Any]]:
    """A dispatcher's reader (saved by the main process only), else ``None``."""
    main = states[0] if states else None
    if main is None or main[S.MODE] != S.DISPATCH_MODE or not isinstance(main.get(S.BASE), Mapping):
        return None
    return main[S.BASE]


def _rank(ckpt: Checkpoint, index: int, states: list, rank: int) -> dict:
    state = states[rank]
    row = {
        "rank": rank,
        "epoch": state[S.EPOCH],
        "batches_taken": state[S.BATCHES_YIELDED],
        "batches_in_epoch": None,
        "epoch_fraction": None,
        "samples_consumed": None,
        "samples_in_epoch": None,
        "workers": state[S.TOPOLOGY].get("num_workers"),
        "seed": state[S.SEED],
        "seed_source": state[S.SEED_SOURCE],
        "logical_shards": None,
        "replayed_samples": None,
        "skipped_samples": None,
        "mixture_sources": None,
    }
    if is_map_style(with_reader(states, rank)):
        row.update(_map_position(ckpt, index, states, rank))
        return row
    position = _reader_state(states) or state
    try:
        if position[S.MODE] == S.STREAM_MODE:
            row.update(_stream_position(position))
        elif position[S.MODE] == S.ROUND_ROBIN_MODE:
            source = position.get(S.SOURCE)
            row["replayed_samples"] = source["items"] if isinstance(source, Mapping) and "items" in source else 0
    except (KeyError, TypeError, AttributeError) as exc:
        raise UnreadableCheckpoint(
            f"{ckpt.path}: loader {index}, rank {rank}: the stream position is damaged ({exc!r}); resume from "
            "another checkpoint"
        ) from None
    return row


def _map_position(ckpt: Checkpoint, index: int, states: list, rank: int) -> dict:
    """Length, progress and samples of a map-style loader, as the loader resumed from the state reports them."""
    try:
        found = map_position(states, rank)
    except StatefulLoaderError as exc:
        raise UnreadableCheckpoint(f"{ckpt.path}: loader {index}, rank {rank}: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise UnreadableCheckpoint(
            f"{ckpt.path}: loader {index}, rank {rank}: the position is damaged ({exc!r}); resume from another "
            "checkpoint"
        ) from None
    shard = _reader_state(states) or states[rank]
    samples = striped_settings(shard[S.CONFIG], shard)["num_samples"]  # a DistributedSampler's: its global order
    skipped = [list(r) for r in shard.get(S.SKIPPED, [])]
    return {**found, "samples_consumed": shard[S.SAMPLES_CONSUMED], "samples_in_epoch": samples,
            "skipped_samples": skipped}


def _stream_position(state: Mapping[str, Any]) -> dict:
    stream = state[S.STREAM]
    snapshots = [s for s in stream["snapshots"] if s is not None]
    found: dict = {"workers_taken": list(stream["taken"])}
    datasets = [s.get("dataset") for s in snapshots]
    if stream["stateful"] and datasets and all(isinstance(d, Mapping) and set(d) == _LOGICAL for d in datasets):
        merged = merge_positions(snapshots)
        found["logical_shards"] = {"positions": merged["positions"], "done": merged["done"]}
    # What a resume reads again and drops: the items each unfinished reader had read (as the loader counts it).
    found["replayed_samples"] = 0 if stream["stateful"] else sum(s["items"] for s in snapshots if not s["ended"])
    found["skipped_samples"] = [list(r) for r in state.get(S.SKIPPED, [])]  # item indices of a composable source
    found["mixture_sources"] = source_counts(state) or None  # a Mixture's (outermost) per-source counters
    return found


# --------------------------------------------------------------------------- human output
_COLUMNS = ("rank", "epoch", "batches taken", "samples taken", "workers", "replayed", "seed", "seed from")


def format_report(report: dict) -> str:
    """A compact table per loader: batches are this rank's, samples are all ranks' together."""
    lines = [f"checkpoint  {report['checkpoint']}", f"complete    {_status(report)}"]
    lines += [f"  problem: {p['message']}" for p in report["problems"]]
    lines.append(carry_line(report["gradient_carry"]))
    for loader in report["loaders"]:
        reads = f" reading {loader['reads']}" if loader["reads"] else ""
        config = ", ".join(f"{k}={v}" for k, v in sorted((loader["config"] or {}).items()))
        lines += ["", f"loader {loader['loader']}: {loader['kind']}{reads} (format {loader['format_version']}) "
                      f"{config}"]
        lines += _table([_cells(row) for row in loader["ranks"]])
        skipped = next((row["skipped_samples"] for row in loader["ranks"] if row.get("skipped_samples")), None)
        if skipped:
            lines.append("  skipped samples (skip_samples): " + ", ".join(
                f"[{start}, {stop}) of epoch {epoch}" for epoch, start, stop in skipped))
        lines += _mixture_lines(loader["ranks"])
        for row in loader["ranks"]:
            shards = row.get("logical_shards")
            if shards:
                where = " ".join(f"{i}@{p}" for i, p in sorted(shards["positions"].items(), key=lambda kv: int(kv[0])))
                lines.append(f"  rank {row['rank']} logical shards: {where or '-'}; done {shards['done'] or '-'}")
    return "\n".join(lines)


def _mixture_lines(rows: list) -> list:
    """A Mixture's per-source counters, from the first rank that has them (one rank's worker shares hold every
    rank's samples)."""
    row = next((row for row in rows if row.get("mixture_sources")), None)
    if row is None:
        return []
    counts = row["mixture_sources"]
    shown = "; ".join(f"{name} {c['samples']} samples, {c['tokens']} tokens" for name, c in counts.items())
    return [f"  mixture sources, delivered in epoch {row['epoch']} (all ranks): {shown}"]


def _status(report: dict) -> str:
    shape = f"world size {report['world_size']}, {report['num_loaders']} loader(s)"
    if report["manifest_problem"] is not None:  # no manifest version to show: say why
        return (f"NO (the manifest is {report['manifest_problem']}, see the problems below; {shape} from the "
                "loader files found)")
    return f"{'yes' if report['complete'] else 'NO'} (manifest version {report['manifest_version']}, {shape})"


def _cells(row: dict) -> list:
    """One rank's row: batches of this rank ("4 of 7"), samples of all ranks ("32 of 50 (64.0%)")."""
    batches = str(row["batches_taken"])
    if row["batches_in_epoch"] is not None:
        batches += f" of {row['batches_in_epoch']}"
    samples = "-"
    if row["samples_consumed"] is not None:
        total = row.get("samples_in_epoch")
        share = f" ({100 * row['samples_consumed'] / total:.1f}%)" if total else ""
        samples = f"{row['samples_consumed']} of {total}{share}"
    return [str(row["rank"]), str(row["epoch"]), batches, samples,
            *(_cell(row[key]) for key in ("workers", "replayed_samples", "seed", "seed_source"))]


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def _table(rows: list) -> list:
    header = list(_COLUMNS)
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
