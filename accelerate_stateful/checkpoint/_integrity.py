"""Whether a checkpoint's files are the ones its save wrote: every file listed, sized and hashed.

A manifest lists every file of its folder (Accelerate's model, optimizer, scheduler, random states and
custom objects, the Trainer's files, this package's own) with its size and SHA-256, and carries a checksum
of itself. The hashes are taken right after the files are written, while they are still in the page cache,
several files at once (``hashlib`` releases the GIL while it hashes), and the processes that share a folder
split its files between them (:func:`share`).

Two depths of check:

- **complete** (:func:`file_problem` with ``hashes=False``): every listed file present, of its size, and
  this package's own (small) files of their hash. What finding the newest checkpoint and rotation ask.
- **intact** (``hashes=True``): the same, every hash too, and no file that the manifest does not list.
  What ``load_state``/``resume()`` and ``accelerate-stateful verify`` ask.

A manifest written before every file was hashed lists some files with a size alone; they are checked for
their size, and ``verify`` says they could not be checked further.

``IO`` counts the files opened for reading and the ``stat`` calls made, so that a benchmark can report the
reads a resume costs each rank.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, Optional, TypeVar

T = TypeVar("T")

SUBDIR = "accelerate_stateful"
MANIFEST = "MANIFEST.json"
CHECKSUM = "manifest_sha256"
_CHUNK = 4 << 20
_PARALLEL_BYTES = 16 << 20  # under this, hashing in one thread (about 30 ms) beats starting a pool

# Reads made by the checkpoint modules: "open" (a file read), "stat" (a size or existence check).
IO: Counter = Counter()


def sha256_file(path: Path) -> str:
    """The SHA-256 of the file at ``path``, read in chunks (a file of any size costs a few MB of memory)."""
    IO["open"] += 1
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        if os.fstat(f.fileno()).st_size < _CHUNK:  # most files of a checkpoint: one read, no 4 MB buffer
            digest.update(f.read())
            return digest.hexdigest()
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        while True:
            read = f.readinto(buffer)
            if not read:
                return digest.hexdigest()
            digest.update(view[:read])


def size_of(path: Path) -> Optional[int]:
    """The size of ``path``, or ``None`` where it is not a file."""
    IO["stat"] += 1
    try:
        return path.stat().st_size if path.is_file() else None
    except OSError:
        return None


def listing(checkpoint: Path) -> list[str]:
    """Every file of the checkpoint folder, relative and sorted: what its manifest lists. Hidden files (a save's
    temporary files, an editor's or a file browser's) and the manifest itself are left out."""
    root = os.fspath(checkpoint)
    names = []
    for folder, _, files in os.walk(root):  # as Path.rglob: symbolic links to folders are not entered
        prefix = os.path.relpath(folder, root).replace(os.sep, "/") + "/" if folder != root else ""
        names += [prefix + name for name in files
                  if not name.startswith(".") and os.path.isfile(os.path.join(folder, name))]
    return sorted(n for n in names if n != f"{SUBDIR}/{MANIFEST}")


def in_parallel(work: Callable[[str], T], names: Iterable[str], size: Optional[int] = None) -> list[T]:
    """``work(name)`` for each name, several files at a time, in order; one at a time where their ``size``
    (bytes, if known) is read faster than threads start."""
    names = list(names)
    threads = min(len(names), os.cpu_count() or 1, 8)
    if threads <= 1 or (size is not None and size < _PARALLEL_BYTES):
        return [work(n) for n in names]
    with ThreadPoolExecutor(threads, thread_name_prefix="accelerate_stateful-hash") as pool:
        return list(pool.map(work, names))


def entries(checkpoint: Path, names: Iterable[str], known: Optional[dict[str, dict]] = None) -> dict[str, dict]:
    """Manifest entries (size, sha256) of ``names``; an entry in ``known`` of the same size is taken as it is
    (the bytes were hashed as they were written)."""
    checkpoint, known = Path(checkpoint), known or {}
    sizes = {rel: (checkpoint / rel).stat().st_size for rel in names}

    def hashed(rel: str) -> Optional[str]:
        entry = known.get(rel, {})
        return entry["sha256"] if entry.get("size") == sizes[rel] and "sha256" in entry else None

    def entry(rel: str) -> dict:
        return {"size": sizes[rel], "sha256": hashed(rel) or sha256_file(checkpoint / rel)}

    fresh = sum(size for rel, size in sizes.items() if hashed(rel) is None)
    return dict(zip(sizes, in_parallel(entry, sizes, fresh)))


def share(names: Iterable[str], sizes: dict[str, int], index: int, count: int) -> list[str]:
    """The files process ``index`` of ``count`` hashes: the largest first, each to the least loaded process.
    A pure function of its arguments, so every process computes the same split."""
    loads, mine = [0] * count, []
    for name in sorted(names, key=lambda n: (-sizes.get(n, 0), n)):
        who = min(range(count), key=lambda i: (loads[i], i))
        loads[who] += sizes.get(name, 0) + 1
        if who == index:
            mine.append(name)
    return sorted(mine)


def file_problem(checkpoint: Path, rel: str, entry: dict, hashes: bool) -> Optional[str]:
    """What is wrong with the listed file ``rel``, or ``None``: missing, another size, another hash (checked for
    every file with ``hashes``, else for this package's own files only)."""
    path = Path(checkpoint) / rel
    size = size_of(path)
    if size is None:
        return (f"{checkpoint} is incomplete: {rel} is listed in its manifest but missing; resume from another "
                "checkpoint")
    if size != entry.get("size"):
        return (f"{path} has {size} bytes, its manifest says {entry.get('size')}; the file is truncated or was "
                "replaced, resume from another checkpoint")
    hashed = hashes or rel.startswith(f"{SUBDIR}/")
    if hashed and "sha256" in entry and sha256_file(path) != entry["sha256"]:
        return (f"{path} does not match the hash in its manifest (same size, other bytes); the file was changed "
                "or damaged after the save, resume from another checkpoint")
    return None


def unlisted_problem(checkpoint: Path, rel: str) -> str:
    return (f"{Path(checkpoint) / rel} is not listed in the manifest: it was added after the save or belongs to "
            "another one; remove it, or resume from another checkpoint")


def problems(checkpoint: Path, manifest: dict, names: Optional[Iterable[str]] = None, hashes: bool = True,
             unlisted: bool = True) -> list[tuple[str, str]]:
    """Every ``(file, message)`` wrong with the listed files ``names`` (all by default), and with ``unlisted``
    the files present but not listed."""
    listed = manifest["files"]
    names = list(listed if names is None else names)
    size = sum(listed[rel].get("size", 0) for rel in names) if hashes else 0
    found = in_parallel(lambda rel: file_problem(checkpoint, rel, listed[rel], hashes), names, size)
    wrong = [(rel, message) for rel, message in zip(names, found) if message is not None]
    if unlisted:
        wrong += [(rel, unlisted_problem(checkpoint, rel)) for rel in listing(checkpoint) if rel not in listed]
    return wrong


def unhashed(manifest: dict) -> list[str]:
    """Listed files without a hash (a manifest of a release that hashed only its own files): size-checked only."""
    return [rel for rel, entry in manifest["files"].items() if "sha256" not in entry]


def checksum(manifest: dict) -> str:
    """The SHA-256 of the manifest's content, its own checksum left out: a changed byte anywhere shows."""
    content = {k: v for k, v in manifest.items() if k != CHECKSUM}
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
