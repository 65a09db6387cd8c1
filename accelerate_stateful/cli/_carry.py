"""The partial gradient a checkpoint carries (saved inside an accumulation window), read without torch.

Each rank's ``gradients.rank_<r>.safetensors`` (``training/_accumulation``) is sized from its safetensors
header: the bytes of its tensors, and what they are — ``grad`` (a parameter's ``.grad``, as under DDP) or the
FSDP2 states ``unsharded`` (the window's unreduced gradient, the parameter's size), ``shard`` (a reduced
shard) and ``accumulated`` (in the reduce dtype).
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from ..checkpoint import _files

_NAME = re.compile(rf"{re.escape(_files.SUBDIR)}/gradients\.rank_(\d+)\.safetensors")


def describe_carry(path: Any, manifest: Optional[dict]) -> Optional[dict]:
    """``{"bytes", "ranks": [{"rank", "bytes", "kinds"}]}``, or ``None`` when nothing is carried."""
    if manifest is not None:
        names = list(manifest.get("files", {}))
    else:
        names = [p.relative_to(path).as_posix() for p in (path / _files.SUBDIR).glob("gradients.rank_*.safetensors")]
    found = sorted((int(m.group(1)), name) for name in names if (m := _NAME.fullmatch(name)))
    if not found:
        return None
    ranks = [{"rank": rank, **_sized(path / name)} for rank, name in found]
    return {"bytes": sum(r["bytes"] or 0 for r in ranks), "ranks": ranks}


def _sized(file: Any) -> dict:
    """The tensor bytes and kinds of one file, from its header; ``None`` for a file that cannot be read."""
    try:
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    except (OSError, ValueError):
        return {"bytes": None, "kinds": []}
    specs = {key: spec for key, spec in header.items() if key != "__metadata__"}
    size = sum(spec["data_offsets"][1] - spec["data_offsets"][0] for spec in specs.values())
    kinds = sorted({key.rpartition("@")[2] if "@" in key else "grad" for key in specs})
    return {"bytes": size, "kinds": kinds}


def carry_line(carry: Optional[dict]) -> str:
    """The report's line: what the carry costs, per rank."""
    if carry is None:
        return "gradients   none carried (saved at an accumulation-window boundary)"
    ranks = carry["ranks"]
    kinds = sorted({kind for r in ranks for kind in r["kinds"]})
    per_rank = ", ".join("?" if r["bytes"] is None else _files.human_size(r["bytes"]) for r in ranks)
    total = _files.human_size(carry["bytes"])
    return f"gradients   {total} carried from inside an accumulation window ({per_rank} per rank; {', '.join(kinds)})"
