"""Checkpoints written by many processes: entering together, numbering, sealing each folder, rotation.

The rules, each held here by construction:

- **Everyone enters.** ``save_state`` and ``load_state`` are collective; a rank that calls one alone
  (``if accelerator.is_main_process: accelerator.save_state()``) is told so within
  ``ENTRY_TIMEOUT_S`` (through the process group's store, never a collective that could pair with
  another), instead of waiting for the collective timeout.
- **A failure anywhere is a failure everywhere.** A step that can fail on one rank runs under
  :func:`agree`, which raises on every rank, so no rank waits in a collective for one that gave up.
- **Every folder is sealed.** Each folder a process saved into gets a manifest of its own, written
  by one process of that folder after every rank finished: the main process for the folder it
  shares, and the lowest rank of each folder the main process cannot see (node-local disks, a
  folder per process). The manifest lists the ranks whose states that folder holds.
- **Numbering continues after the newest checkpoint present**, however the run started (``resume()``,
  ``load_state()``, or neither), agreed over every rank's folders; rotation never removes the
  checkpoint just written.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import torch.distributed as dist

from . import _files
from .._context import DistContext
from ..errors import CheckpointError, LifecycleError, StatefulLoaderError, UnsupportedConfigError

logger = logging.getLogger(__name__)

T = TypeVar("T")
ENTRY_TIMEOUT_ENV = "ACCELERATE_STATEFUL_ENTRY_TIMEOUT"
ENTRY_TIMEOUT_S = 60.0
_entered: Counter = Counter()  # per process: how many times each collective operation began


# --------------------------------------------------------------------------- every rank, together
def enter(ctx: DistContext, operation: str) -> None:
    """Wait until every rank has called ``operation``; refuse with the fix if one does not come.

    Raises:
        CheckpointError: some rank did not call ``operation`` within the entry timeout.
    """
    if not ctx.is_collective:
        return
    _entered[operation] += 1
    key = f"accelerate_stateful/{operation}/{_entered[operation]}"
    store = dist.distributed_c10d._get_default_store()  # the rendezvous store every rank already shares
    store.set(f"{key}/rank_{ctx.rank}", "1")
    timeout = float(os.environ.get(ENTRY_TIMEOUT_ENV, ENTRY_TIMEOUT_S))
    deadline, pause = time.monotonic() + timeout, 0.001
    arrived = store.add(key, 1)
    while arrived < ctx.world_size:
        if time.monotonic() > deadline:
            missing = [r for r in range(ctx.world_size) if not store.check([f"{key}/rank_{r}"])]
            raise CheckpointError(
                f"accelerator.{operation}() was called on rank {ctx.rank}, but rank(s) {missing} did not call it "
                f"within {timeout:.0f} s: call accelerator.{operation}() on every process, not under "
                f"`if accelerator.is_main_process:` (each process writes and reads its own part of the "
                f"checkpoint); if a process is only slower to get there, raise the limit with "
                f"{ENTRY_TIMEOUT_ENV}=<seconds>"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
        arrived = store.add(key, 0)


def agree(ctx: DistContext, work: Callable[[], T]) -> T:
    """``work()`` on this rank; if it raised on any rank, raise on every rank (this rank's own error first)."""
    try:
        result, failure = work(), None
    except Exception as exc:  # re-raised below, on this rank and, through the gather, on every other
        result, failure = None, exc
    verdicts = ctx.all_gather(None if failure is None else (type(failure).__name__, str(failure)))
    if failure is not None:
        raise failure
    for rank, verdict in enumerate(verdicts):
        if verdict is not None:
            kind = _ERRORS.get(verdict[0], CheckpointError)
            raise kind(f"rank {rank} failed: {verdict[1]}")
    return result


_ERRORS = {cls.__name__: cls for cls in (CheckpointError, UnsupportedConfigError, LifecycleError, StatefulLoaderError)}


# --------------------------------------------------------------------------- numbering and leftovers
def newest_sealed(root: Path) -> int:
    """The number of the newest ``checkpoint_<N>`` under ``root`` that has a manifest, or -1."""
    return next((_files.checkpoint_number(p) for p in _files.numbered_checkpoints(root) if _files.has_manifest(p)),
                -1)


def next_number(ctx: DistContext, root: Path, iteration: int) -> int:
    """The number of the next automatic checkpoint: after the newest one any rank has, and not below
    ``iteration`` (``ProjectConfiguration.iteration``, which a user may set)."""
    newest = agree(ctx, lambda: newest_sealed(root))
    return max([iteration] + [n + 1 for n in ctx.all_gather(newest)])


def clear_unfinished(ctx: DistContext, folder: Path) -> None:
    """Remove a leftover of a save killed before its manifest, in every folder that has one; never a sealed one."""
    def check() -> bool:
        if _files.has_manifest(folder):
            raise CheckpointError(
                f"{folder} already holds a checkpoint; call resume() first so numbering continues after it, "
                "or set project_configuration.iteration past it"
            )
        return folder.exists()

    present = agree(ctx, check)
    if ctx.is_main and present:  # a folder shared with the main process: removed once, by it
        logger.warning("removing %s: an unfinished save (no manifest)", folder)
        agree(ctx, lambda: _remove(folder))
    else:
        agree(ctx, lambda: None)
    # Folders the main process cannot see: the lowest rank that still sees one removes it.
    seen = ctx.all_gather((folder.exists(), socket.gethostname(), os.path.realpath(folder)))
    mine = seen[ctx.rank]
    first = next(r for r, s in enumerate(seen) if s == mine)
    agree(ctx, lambda: _remove(folder) if mine[0] and first == ctx.rank else None)


def _remove(folder: Path) -> None:
    def gone_already(function: Any, path: str, exc_info: Any) -> None:
        if not isinstance(exc_info[1], FileNotFoundError):
            raise exc_info[1]

    shutil.rmtree(folder, onerror=gone_already)


# --------------------------------------------------------------------------- sealing
def seal(ctx: DistContext, folder: Path, *, num_loaders: int, entries: dict[str, dict],
         root: Optional[Path] = None, keep: Optional[int] = None) -> None:
    """Write a manifest into every folder the ranks saved into, then rotate ``root`` to ``keep`` checkpoints.

    Args:
        entries: This rank's loader files (size, sha256), known from the bytes it wrote.
    """
    save_id = ctx.broadcast(uuid.uuid4().hex)
    probe = folder / _files.SUBDIR / f".main.{save_id}"
    if ctx.is_main:
        agree(ctx, lambda: _files.write_atomic(probe, b""))
    else:
        agree(ctx, lambda: None)
    # Which folder each rank wrote into: the main process's (it sees the probe), else its own.
    here = "main" if probe.exists() else (socket.gethostname(), os.path.realpath(folder))
    folders = ctx.all_gather(here)
    members = [r for r, f in enumerate(folders) if f == here]
    leader = members[0] == ctx.rank

    def write() -> None:
        if not leader:
            return
        _files.write_manifest(folder, world_size=ctx.world_size, num_loaders=num_loaders, ranks=members,
                              hashes=entries, extra={"save_id": save_id})
        probe.unlink(missing_ok=True)
        if root is not None and keep is not None:
            rotate(root, keep=keep, just_written=folder)

    agree(ctx, write)


def rotate(root: Path, keep: int, just_written: Path) -> None:
    """Keep ``just_written`` and the newest complete checkpoints up to ``keep`` in all; remove older ones,
    and unfinished leftovers older than the oldest kept."""
    numbered = _files.numbered_checkpoints(root)
    kept = [just_written]
    for path in numbered:
        if len(kept) >= max(keep, 1):
            break
        if path != just_written and _files.is_complete(path):
            kept.append(path)
    oldest_kept = min(_files.checkpoint_number(p) for p in kept)
    for path in numbered:
        if path not in kept and _files.checkpoint_number(path) < oldest_kept:
            shutil.rmtree(path)
