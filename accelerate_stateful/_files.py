"""Safe files: loader states as JSON plus safetensors, a manifest written last, atomic writes.

Nothing here unpickles. A state tree may hold dicts, lists, tuples, str, int,
float, bool, None, bytes and tensors; tensors go to a safetensors file and the
JSON holds a reference to them. Anything else fails at save time, naming the
key's path.

Layout inside a checkpoint directory::

    <checkpoint>/accelerate_stateful/
        loader_0.rank_0.json          one file per loader per rank
        loader_0.rank_0.safetensors   only when that state holds tensors
        MANIFEST.json                 written last, by the main process, after every rank finished
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .errors import CheckpointError, StateSerializationError

SUBDIR = "accelerate_stateful"
MANIFEST = "MANIFEST.json"
MANIFEST_VERSION = 1
_CHECKPOINT_NAME = re.compile(r"^checkpoint_(\d+)$")

# Markers of the JSON encoding; a user dict may not use these as its only key.
_TENSOR, _TUPLE, _BYTES, _PAIRS = "__tensor__", "__tuple__", "__bytes__", "__pairs__"
_MARKERS = {_TENSOR, _TUPLE, _BYTES, _PAIRS}


# --------------------------------------------------------------------------- encoding
def encode(tree: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """Split a state tree into a JSON-safe tree and the tensors it refers to."""
    tensors: dict[str, torch.Tensor] = {}
    return _encode(tree, "", tensors), tensors


def _encode(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise StateSerializationError(f"cannot store the non-finite float {value} at '{path}'", path)
        return value
    if isinstance(value, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = value.detach().cpu().contiguous()
        return {_TENSOR: key}
    if isinstance(value, (bytes, bytearray)):
        return {_BYTES: base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not (len(value) == 1 and set(value) <= _MARKERS):
            return {k: _encode(v, f"{path}/{k}", tensors) for k, v in value.items()}
        pairs = []
        for k, v in value.items():
            if k is not None and not isinstance(k, (bool, int, str)):
                raise StateSerializationError(
                    f"cannot store the dict key {k!r} ({type(k).__name__}) at '{path}': keys must be str, int or bool",
                    path,
                )
            pairs.append([k, _encode(v, f"{path}/{k}", tensors)])
        return {_PAIRS: pairs}
    raise StateSerializationError(
        f"cannot store a {type(value).__module__}.{type(value).__qualname__} at '{path or '/'}': loader states "
        "hold only dicts, lists, tuples, str, int, float, bool, None, bytes and tensors; make the dataset's "
        "state_dict() return those",
        path or "/",
    )


def decode(tree: Any, tensors: dict[str, torch.Tensor], source: str = "") -> Any:
    """Rebuild a state tree from :func:`encode`'s output."""
    if isinstance(tree, list):
        return [decode(v, tensors, source) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if len(tree) == 1:
        (marker, payload), = tree.items()
        if marker == _TENSOR:
            if payload not in tensors:
                raise CheckpointError(
                    f"{source}: refers to tensor '{payload}', which its safetensors file lacks; the file is "
                    "damaged or was replaced, resume from another checkpoint"
                )
            return tensors[payload]
        if marker == _TUPLE:
            return tuple(decode(v, tensors, source) for v in payload)
        if marker == _BYTES:
            return base64.b64decode(payload)
        if marker == _PAIRS:
            return {k: decode(v, tensors, source) for k, v in payload}
    return {k: decode(v, tensors, source) for k, v in tree.items()}


# --------------------------------------------------------------------------- atomic files
def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a kill leaves either the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# --------------------------------------------------------------------------- loader states
def state_file(checkpoint: Path, loader: int, rank: int, suffix: str = "json") -> Path:
    return Path(checkpoint) / SUBDIR / f"loader_{loader}.rank_{rank}.{suffix}"


def write_loader_state(checkpoint: Path, loader: int, rank: int, state: Any) -> list[Path]:
    """Write one rank's state of one loader; returns the files written."""
    tree, tensors = encode(state)
    (Path(checkpoint) / SUBDIR).mkdir(parents=True, exist_ok=True)
    written = []
    if tensors:
        tensor_path = state_file(checkpoint, loader, rank, "safetensors")
        write_atomic(tensor_path, st_save(tensors))
        written.append(tensor_path)
    json_path = state_file(checkpoint, loader, rank)
    write_atomic(json_path, json.dumps(tree, sort_keys=True, allow_nan=False).encode())
    written.append(json_path)
    return written


def read_loader_state(checkpoint: Path, loader: int, rank: int) -> Any:
    """Read one rank's state of one loader, refusing anything that is not our own format."""
    json_path = state_file(checkpoint, loader, rank)
    if not json_path.is_file():
        raise CheckpointError(
            f"{json_path} is missing: the checkpoint has no state for loader {loader} on rank {rank}; "
            "it was written by another number of processes or loaders, or is damaged; resume from another checkpoint"
        )
    raw = json_path.read_bytes()
    try:
        tree = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(
            f"{json_path} is not a valid JSON loader state ({exc}); the file is truncated or damaged, "
            "resume from another checkpoint"
        ) from None
    tensor_path = state_file(checkpoint, loader, rank, "safetensors")
    tensors: dict[str, torch.Tensor] = {}
    if tensor_path.is_file():
        try:
            tensors = st_load(tensor_path.read_bytes())
        except Exception as exc:  # safetensors raises its own SafetensorError
            raise CheckpointError(
                f"{tensor_path} is not a valid safetensors file ({exc}); resume from another checkpoint"
            ) from None
    return decode(tree, tensors, str(json_path))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


# --------------------------------------------------------------------------- manifest
def write_manifest(checkpoint: Path, *, world_size: int, num_loaders: int, extra: Optional[dict] = None) -> Path:
    """Record every file of the checkpoint (size, and hash for ours); written last, atomically."""
    checkpoint = Path(checkpoint)
    files = {}
    for path in sorted(p for p in checkpoint.rglob("*") if p.is_file() and not p.name.startswith(".")):
        rel = path.relative_to(checkpoint).as_posix()
        if rel == f"{SUBDIR}/{MANIFEST}":
            continue
        entry = {"size": path.stat().st_size}
        if rel.startswith(f"{SUBDIR}/"):
            entry["sha256"] = _sha256(path)
        files[rel] = entry
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "world_size": world_size,
        "num_loaders": num_loaders,
        "files": files,
        **(extra or {}),
    }
    path = checkpoint / SUBDIR / MANIFEST
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(manifest, indent=1, sort_keys=True).encode())
    return path


def read_manifest(checkpoint: Path) -> dict:
    """The manifest of a complete checkpoint; raises ``CheckpointError`` for an incomplete or damaged one."""
    checkpoint = Path(checkpoint)
    path = checkpoint / SUBDIR / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{checkpoint} is incomplete: it has no {SUBDIR}/{MANIFEST} (the save was interrupted, or the folder "
            "was not written by accelerate_stateful); resume from an earlier checkpoint"
        )
    try:
        manifest = json.loads(path.read_text("utf-8"), parse_constant=_reject_constant)
        files = manifest["files"]
        int(manifest["world_size"]), int(manifest["num_loaders"])
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} is damaged ({exc!r}); resume from an earlier checkpoint") from None
    for rel, entry in files.items():
        _check_file(checkpoint, rel, entry)
    return manifest


def _check_file(checkpoint: Path, rel: str, entry: dict) -> None:
    path = checkpoint / rel
    if not path.is_file():
        raise CheckpointError(
            f"{checkpoint} is incomplete: {rel} is listed in its manifest but missing; resume from another checkpoint"
        )
    if path.stat().st_size != entry.get("size"):
        raise CheckpointError(
            f"{path} has {path.stat().st_size} bytes, its manifest says {entry.get('size')}; the file is "
            "truncated or was replaced, resume from another checkpoint"
        )
    if "sha256" in entry and _sha256(path) != entry["sha256"]:
        raise CheckpointError(
            f"{path} does not match the hash in its manifest; the file was changed after the save, "
            "resume from another checkpoint"
        )


def is_complete(checkpoint: Path) -> bool:
    try:
        read_manifest(checkpoint)
    except CheckpointError:
        return False
    return True


# --------------------------------------------------------------------------- finding checkpoints
def checkpoint_number(path: Path) -> Optional[int]:
    match = _CHECKPOINT_NAME.match(Path(path).name)
    return int(match.group(1)) if match else None


def numbered_checkpoints(root: Path) -> list[Path]:
    """``checkpoint_<N>`` folders under ``root``, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and checkpoint_number(p) is not None]
    return sorted(found, key=checkpoint_number, reverse=True)


def latest_checkpoint(root: Path) -> Optional[Path]:
    """The newest complete ``checkpoint_<N>`` under ``root``, or ``None``."""
    return next((p for p in numbered_checkpoints(root) if is_complete(p)), None)


def complete_checkpoints(root: Path) -> Iterable[Path]:
    return [p for p in numbered_checkpoints(root) if is_complete(p)]
