"""Safe files: loader states as JSON plus safetensors, a manifest written last, atomic writes.

Nothing here unpickles. A state tree may hold dicts, lists, tuples, str, int,
float, bool, None, bytes and tensors; tensors go to a safetensors file and the
JSON holds a reference to them. Anything else fails at save time, naming the
key's path.

Layout inside a checkpoint directory::

    <checkpoint>/accelerate_stateful/
        loader_0.rank_0.json          one file per loader per rank
        loader_0.rank_0.safetensors   only when that state holds tensors
        MANIFEST.json                 written last, after every rank finished, by one process per folder

Where ranks do not share the folder (node-local disks, a folder per process), each folder gets a
manifest of its own listing the ranks whose states it holds (see ``_checkpoints``). The manifest lists
every file of its folder with its size and SHA-256 (``_integrity``), and a checksum of itself.

``IO`` counts the files this module opens for reading and the ``stat`` calls it makes, so that a
benchmark can report the reads a resume costs each rank.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

from . import _integrity
from ._integrity import IO, MANIFEST, SUBDIR
from ._versions import refuse_unknown_version
from ..errors import CheckpointError, StateSerializationError

if TYPE_CHECKING:
    import torch

# torch is imported where tensors are written or read, not here: the command line reads states without it.

MANIFEST_VERSION = 1
SUPPORTED_MANIFEST_VERSIONS = (1,)
_CHECKPOINT_NAME = re.compile(r"^checkpoint_(\d+)$")

# Markers of the JSON encoding; a user dict may not use these as its only key.
_TENSOR, _TUPLE, _BYTES, _PAIRS = "__tensor__", "__tuple__", "__bytes__", "__pairs__"
_MARKERS = {_TENSOR, _TUPLE, _BYTES, _PAIRS}

def _read_bytes(path: Path) -> bytes:
    IO["open"] += 1
    return Path(path).read_bytes()


_size = _integrity.size_of


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
    if _is_tensor(value):
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


def _is_tensor(value: Any) -> bool:
    """Whether ``value`` is a tensor; without torch imported, nothing is."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


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


def human_size(size: int) -> str:
    """``size`` bytes in words: ``"512 B"``, ``"1.5 kB"``, ``"40.0 MB"``, ``"2.24 GB"`` (powers of 1000)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.{2 if unit == 'GB' else 1}f} {unit}"
    return f"{size} B"


def file_entry(path: Path) -> dict:
    """A manifest entry (size, sha256) for a file this process has just written."""
    return {"size": Path(path).stat().st_size, "sha256": _integrity.sha256_file(path)}


# --------------------------------------------------------------------------- loader states
def state_file(checkpoint: Path, loader: int, rank: int, suffix: str = "json") -> Path:
    return Path(checkpoint) / SUBDIR / f"loader_{loader}.rank_{rank}.{suffix}"


def write_loader_state(checkpoint: Path, loader: int, rank: int, state: Any) -> list[Path]:
    """Write one rank's state of one loader; returns the files written."""
    return [Path(checkpoint) / rel for rel in write_encoded(checkpoint, loader, rank, encode_state(state))]


def encode_state(state: Any) -> dict[str, bytes]:
    """The file contents of one loader state, by suffix: ``json`` and, where it holds tensors, ``safetensors``."""
    tree, tensors = encode(state)
    contents = {"json": json.dumps(tree, sort_keys=True, allow_nan=False).encode()}
    if tensors:
        from safetensors.torch import save

        contents["safetensors"] = save(tensors)
    return contents


def write_encoded(checkpoint: Path, loader: int, rank: int, contents: dict[str, bytes]) -> dict[str, dict]:
    """Write :func:`encode_state`'s files (the JSON last); returns their manifest entries (size, sha256)."""
    (Path(checkpoint) / SUBDIR).mkdir(parents=True, exist_ok=True)
    entries = {}
    for suffix in sorted(contents, key=lambda s: s == "json"):
        path = state_file(checkpoint, loader, rank, suffix)
        write_atomic(path, contents[suffix])
        rel = path.relative_to(checkpoint).as_posix()
        entries[rel] = {"size": len(contents[suffix]), "sha256": hashlib.sha256(contents[suffix]).hexdigest()}
    return entries


def read_loader_state(checkpoint: Path, loader: int, rank: int, manifest: Optional[dict] = None,
                      load_tensors: Optional[Callable[[bytes], dict]] = None) -> Any:
    """Read one rank's state of one loader, refusing anything that is not our own format.

    With ``manifest``, each file read is checked against its entry (size and sha256) from the bytes read,
    so a rank verifies its own state without reading anything twice. ``load_tensors`` turns a safetensors
    file's bytes into its tensors (default: torch tensors; the command line reads them without torch).
    """
    json_path = state_file(checkpoint, loader, rank)
    if _size(json_path) is None:
        raise CheckpointError(
            f"{json_path} is missing: the checkpoint has no state for loader {loader} on rank {rank}; "
            "it was written by another number of processes or loaders, or is damaged; resume from another checkpoint"
        )
    raw = _read_bytes(json_path)
    if manifest is not None:
        _check_bytes(checkpoint, json_path, raw, manifest)
    try:
        tree = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(
            f"{json_path} is not a valid JSON loader state ({exc}); the file is truncated or damaged, "
            "resume from another checkpoint"
        ) from None
    tensors = _read_tensors(checkpoint, state_file(checkpoint, loader, rank, "safetensors"), manifest,
                            load_tensors or _torch_tensors)
    return decode(tree, tensors, str(json_path))


def _torch_tensors(raw: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(raw)


def _read_tensors(checkpoint: Path, path: Path, manifest: Optional[dict],
                  load_tensors: Callable[[bytes], dict]) -> dict[str, Any]:
    """The tensors of a state: from its safetensors file where the manifest lists one (or, without a
    manifest, where there is one)."""
    if manifest is not None and Path(path).relative_to(checkpoint).as_posix() not in manifest["files"]:
        return {}
    size = _size(path)
    if size is None and manifest is None:
        return {}
    if size is None:
        raise CheckpointError(
            f"{checkpoint} is incomplete: {path.name} is listed in its manifest but missing; resume from another "
            "checkpoint"
        )
    raw = _read_bytes(path)
    _check_bytes(checkpoint, path, raw, manifest)
    try:
        return load_tensors(raw)
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise CheckpointError(f"{path} is not a valid safetensors file ({exc}); resume from another checkpoint") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _check_bytes(checkpoint: Path, path: Path, raw: bytes, manifest: Optional[dict]) -> None:
    """Refuse ``raw`` (read from ``path``) where it differs from the manifest's entry for it."""
    if manifest is None:
        return
    entry = manifest["files"].get(Path(path).relative_to(checkpoint).as_posix())
    if entry is None:
        raise CheckpointError(
            f"{path} is not listed in {Path(checkpoint) / SUBDIR / MANIFEST}; the file was added after the save or "
            "the manifest belongs to another save, resume from another checkpoint"
        )
    if len(raw) != entry.get("size"):
        raise CheckpointError(
            f"{path} has {len(raw)} bytes, its manifest says {entry.get('size')}; the file is "
            "truncated or was replaced, resume from another checkpoint"
        )
    if "sha256" in entry and hashlib.sha256(raw).hexdigest() != entry["sha256"]:
        raise CheckpointError(
            f"{path} does not match the hash in its manifest; the file was changed after the save, "
            "resume from another checkpoint"
        )


# --------------------------------------------------------------------------- manifest
def write_manifest(checkpoint: Path, *, world_size: int, num_loaders: int, extra: Optional[dict] = None,
                   ranks: Optional[Iterable[int]] = None, hashes: Optional[dict[str, dict]] = None) -> Path:
    """Record every file of the checkpoint folder (size and sha256) and the manifest's own checksum; written
    last, atomically.

    Args:
        ranks: The ranks whose states this folder holds (all of them by default).
        hashes: Entries (size, sha256) of files already hashed (as they were written, or by the other
            processes of the folder), so they are not read again.
    """
    checkpoint = Path(checkpoint)
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "world_size": world_size,
        "num_loaders": num_loaders,
        "ranks": sorted(range(world_size) if ranks is None else ranks),
        "files": _integrity.entries(checkpoint, _integrity.listing(checkpoint), known=hashes),
        **(extra or {}),
    }
    manifest[_integrity.CHECKSUM] = _integrity.checksum(manifest)
    path = checkpoint / SUBDIR / MANIFEST
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(manifest, indent=1, sort_keys=True).encode())
    return path


def hash_share(checkpoint: Path, index: int, count: int, known: Optional[dict[str, dict]] = None) -> dict[str, dict]:
    """Entries (size, sha256) of the files of ``checkpoint`` that process ``index`` of the ``count`` sharing the
    folder hashes for its manifest (:func:`_integrity.share`)."""
    names = _integrity.listing(checkpoint)
    sizes = {rel: (Path(checkpoint) / rel).stat().st_size for rel in names}
    return _integrity.entries(checkpoint, _integrity.share(names, sizes, index, count), known=known)


def read_manifest(checkpoint: Path) -> dict:
    """The manifest of a complete checkpoint; raises ``CheckpointError`` for an incomplete or damaged one.

    Checks that every file the manifest lists is present with its size (a stat each), and the hashes of this
    package's own files; :func:`verify_files` checks every hash.
    """
    manifest = load_manifest(checkpoint)
    _raise_first(_integrity.problems(checkpoint, manifest, hashes=False, unlisted=False))
    return manifest


def load_manifest(checkpoint: Path) -> dict:
    """The parsed manifest of ``checkpoint`` (a version this release reads), without checking the files it lists."""
    checkpoint = Path(checkpoint)
    path = checkpoint / SUBDIR / MANIFEST
    if _size(path) is None:
        raise CheckpointError(_no_manifest(checkpoint))
    manifest = _parse(path, _read_bytes(path))
    refuse_unknown_version("manifest_version", manifest["manifest_version"], SUPPORTED_MANIFEST_VERSIONS, str(path))
    recorded = manifest.pop(_integrity.CHECKSUM, None)  # absent from the manifests of earlier releases
    if recorded is not None and recorded != _integrity.checksum(manifest):
        raise CheckpointError(
            f"{path} was changed after the save: its content no longer matches the checksum written with it (a "
            "damaged disk or an edit by hand), so the list of files it vouches for cannot be trusted; resume from "
            "an earlier checkpoint"
        )
    try:
        world_size, _ = int(manifest["world_size"]), int(manifest["num_loaders"])
        manifest.setdefault("ranks", list(range(world_size)))  # written before per-folder manifests
        ranks = [int(r) for r in manifest["ranks"]]
        if not isinstance(manifest["files"], dict) or not all(0 <= r < world_size for r in ranks):
            raise ValueError(f"ranks {ranks} outside a world of {world_size}, or no file table")
        odd = [rel for rel, entry in manifest["files"].items()
               if not isinstance(entry, dict) or type(entry.get("size")) is not int
               or not isinstance(entry.get("sha256", ""), str)]
        if odd:
            raise ValueError(f"the entries of {odd[:3]} are not {{'size': int, 'sha256': str}}")
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} is damaged ({exc!r}); resume from an earlier checkpoint") from None
    return manifest


def _no_manifest(checkpoint: Path) -> str:
    if not checkpoint.exists():
        return (f"{checkpoint} does not exist: check the path, and pass the folder save_state() wrote (with "
                "automatic_checkpoint_naming, <project_dir>/checkpoints/checkpoint_<N>), or call "
                "accelerator.resume() to load the newest complete checkpoint")
    if not checkpoint.is_dir():
        return f"{checkpoint} is a file, not a checkpoint folder: pass the folder save_state() wrote"
    return (f"{checkpoint} is incomplete: it has no {SUBDIR}/{MANIFEST} (the save was interrupted, or the folder "
            "was not written by accelerate_stateful); resume from an earlier checkpoint")


def _parse(path: Path, raw: bytes) -> dict:
    """The manifest's JSON, with a version; a file cut short or not JSON is named as damaged, in words."""
    try:
        manifest = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError as exc:
        reason = f"it is not text (an invalid byte at offset {exc.start} of {len(raw)})"
    except json.JSONDecodeError as exc:
        cut = exc.pos >= len(raw.rstrip())
        reason = (f"it ends after {len(raw)} bytes, in the middle of its content" if cut
                  else f"it is not valid JSON from byte {exc.pos} of {len(raw)} on ({exc.msg.lower()})")
    except ValueError as exc:  # a NaN or Infinity: never written by a save
        reason = f"it is not valid JSON ({exc})"
    else:
        if isinstance(manifest, dict) and "manifest_version" in manifest:
            return manifest
        reason = "it has no manifest_version"
    raise CheckpointError(
        f"{path} is damaged: {reason}; the file was cut short or changed after the save (a full or failing disk, "
        "a copy that did not finish), so the checkpoint cannot be trusted; resume from an earlier checkpoint"
    )


def verify_files(checkpoint: Path, manifest: dict, share: tuple[int, int] = (0, 1)) -> None:
    """Check that ``checkpoint`` holds exactly the files ``manifest`` lists, each of its size and hash.

    Args:
        share: ``(index, count)``: this process checks only its share of the files (:func:`_integrity.share`),
            where ``count`` processes check one folder together; the first also looks for unlisted files.
    """
    files = manifest["files"]
    index, count = share
    names = _integrity.share(files, {rel: entry["size"] for rel, entry in files.items()}, index, count)
    _raise_first(_integrity.problems(checkpoint, manifest, names, hashes=True, unlisted=index == 0))


def _raise_first(problems: list[tuple[str, str]]) -> None:
    if problems:
        raise CheckpointError(problems[0][1])


def is_complete(checkpoint: Path) -> bool:
    """Whether ``checkpoint``'s manifest is readable and every file it lists is intact."""
    try:
        read_manifest(checkpoint)
    except CheckpointError:
        return False
    return True


def unseal(checkpoint: Path) -> bool:
    """Remove ``checkpoint``'s manifest, durably, before a save writes into it again; whether it had one.

    Until then the folder would pass for the earlier save while it holds the new one's first files: a save
    killed there would be resumed with parts of two saves.
    """
    path = Path(checkpoint) / SUBDIR / MANIFEST
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    _fsync_dir(path.parent)
    return True


def has_manifest(checkpoint: Path) -> bool:
    """Whether a save of ``checkpoint`` got as far as its manifest (one stat; nothing is verified)."""
    return _size(Path(checkpoint) / SUBDIR / MANIFEST) is not None


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
