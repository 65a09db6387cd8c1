"""What changed between two checkpoints of a run, from their reports (``diff``)."""

from __future__ import annotations

from typing import Any, Optional

from ._report import SCHEMA_VERSION

_TOP = (("world_size", "world size"), ("num_loaders", "loaders"), ("complete", "complete"))
_LOADER = (("kind", "kind"), ("reads", "reads"), ("format_version", "format version"))
_RANK = (("epoch", "epoch"), ("batches_taken", "batches taken"), ("samples_consumed", "samples consumed"),
         ("workers", "workers"), ("seed", "seed"), ("seed_source", "seed from"),
         ("replayed_samples", "replayed samples"), ("workers_taken", "batches taken per worker"))


def diff_reports(a: dict, b: dict) -> dict:
    """Every difference between reports ``a`` and ``b``: topology, settings, and each rank's position."""
    changes: list = []
    for key, name in _TOP:
        _compare(changes, name, a[key], b[key])
    ranks_a = {(l["loader"], r["rank"]): r for l in a["loaders"] for r in l["ranks"]}
    ranks_b = {(l["loader"], r["rank"]): r for l in b["loaders"] for r in l["ranks"]}
    for la, lb in zip(a["loaders"], b["loaders"]):
        index = la["loader"]
        for key, name in _LOADER:
            _compare(changes, name, la[key], lb[key], loader=index)
        config_a, config_b = la["config"] or {}, lb["config"] or {}
        for key in sorted(set(config_a) | set(config_b)):
            _compare(changes, key, config_a.get(key), config_b.get(key), loader=index)
    for where in sorted(set(ranks_a) | set(ranks_b)):
        ra, rb = ranks_a.get(where), ranks_b.get(where)
        if ra is None or rb is None:
            changes.append(_change("rank", ra is not None, rb is not None, *where))
            continue
        for key, name in _RANK:
            _compare(changes, name, ra.get(key), rb.get(key), *where)
        _compare(changes, "logical shard positions", _shards(ra), _shards(rb), *where)
    return {"schema_version": SCHEMA_VERSION, "a": a["checkpoint"], "b": b["checkpoint"], "changes": changes}


def _shards(row: dict) -> Optional[dict]:
    shards = row.get("logical_shards")
    return None if shards is None else {"positions": shards["positions"], "done": shards["done"]}


def _change(what: str, a: Any, b: Any, loader: Optional[int] = None, rank: Optional[int] = None) -> dict:
    return {"what": what, "loader": loader, "rank": rank, "a": a, "b": b}


def _compare(changes: list, what: str, a: Any, b: Any, loader: Optional[int] = None,
             rank: Optional[int] = None) -> None:
    if a != b:
        changes.append(_change(what, a, b, loader, rank))


def format_diff(diff: dict) -> str:
    """One line per change; rank presence reads "only in A/B"."""
    lines = [f"A  {diff['a']}", f"B  {diff['b']}"]
    if not diff["changes"]:
        return "\n".join(lines + ["no differences in topology, settings or positions"])
    for change in diff["changes"]:
        where = " ".join(part for part in (
            f"loader {change['loader']}" if change["loader"] is not None else "",
            f"rank {change['rank']}" if change["rank"] is not None else "",
        ) if part)
        prefix = f"{where}: " if where else ""
        if change["what"] == "rank":
            lines.append(f"{prefix}only in {'A' if change['a'] else 'B'}")
        elif change["what"] == "logical shard positions":
            lines.append(f"{prefix}logical shard positions moved (A {_short(change['a'])}; B {_short(change['b'])})")
        else:
            lines.append(f"{prefix}{change['what']}: {change['a']} -> {change['b']}")
    return "\n".join(lines)


def _short(shards: Optional[dict]) -> str:
    if shards is None:
        return "none"
    return ", ".join(f"{i}@{p}" for i, p in sorted(shards["positions"].items(), key=lambda kv: int(kv[0])))
