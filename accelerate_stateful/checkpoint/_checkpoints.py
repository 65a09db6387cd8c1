"""Checkpoints written by many processes: entering together, numbering, sealing each folder, rotation.

The rules, each held here by construction:

- **Everyone enters.** ``save_state``, ``load_state`` and ``resume`` are collective; a rank that calls
  one alone (``if accelerator.is_main_process: accelerator.save_state()``) is told so after half the
  process group's collective timeout (through the process group's store, never a collective that could
  pair with another), before any collective of the job gives up; every rank waiting there, and every
  rank that comes later, raises the same error.
- **A failure anywhere is a failure everywhere.** A step that can fail on one rank runs under
  :func:`agree`, which raises the same error on every rank, so no rank waits in a collective for one
  that gave up, and every rank makes the same collectives afterwards.
- **A folder is unsealed before it changes.** A save into a folder that holds a complete checkpoint
  removes its manifest first, and every rank waits for that before writing, so a save killed there
  leaves an incomplete folder, never one sealed for the earlier save over the later one's files.
- **Every folder is sealed.** Each folder a process saved into gets a manifest of its own, written
  by one process of that folder after every rank finished: the main process for the folder it
  shares, and the lowest rank of each folder the main process cannot see (node-local disks, a
  folder per process). The manifest lists the ranks whose states that folder holds.
- **Numbering continues after the newest checkpoint present**, however the run started (``resume()``,
  ``load_state()``, or neither), agreed over every rank's folders, foreign ones included (``_ownership``);
  rotation never removes the checkpoint just written.
- **Only this package's folders are touched.** A save marks its folder before anything else; a leftover
  is removed, and rotation removes, only folders that carry that marker or a manifest.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import pickle
import shutil
import socket
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import torch.distributed as dist

from .. import _log
from . import _files
from . import _ownership
from .._context import DistContext, package_timeout
from ..errors import CheckpointError, UnsupportedConfigError

logger = _log.get_logger(__name__)

T = TypeVar("T")
ENTRY_TIMEOUT_ENV = "ACCELERATE_STATEFUL_ENTRY_TIMEOUT"
_entered: Counter = Counter()  # per process: how many times each collective operation began


# --------------------------------------------------------------------------- every rank, together
def enter(ctx: DistContext, operation: str) -> None:
    """Wait until every rank has called ``operation``; refuse with the fix, on every rank that waits, if one
    does not come within the entry timeout.

    The ranks meet in the rendezvous store, never in a collective that could pair with another. One verdict
    is stored per call, the first proposed: ``go`` by the rank that completes the count, or the refusal of a
    rank that gave up waiting. Every rank that waits, and every rank that comes later, takes that verdict.

    Raises:
        CheckpointError: some rank did not call ``operation`` within the entry timeout.
        UnsupportedConfigError: the entry timeout set on some rank is not below half the collective timeout.
    """
    if not ctx.is_collective:
        return
    _entered[operation] += 1
    key = f"accelerate_stateful/{operation}/{_entered[operation]}"
    store = dist.distributed_c10d._get_default_store()  # the rendezvous store every rank already shares
    store.set(f"{key}/rank_{ctx.rank}", "1")
    arrived = store.add(key, 1)
    try:
        timeout = package_timeout(ENTRY_TIMEOUT_ENV, default=math.inf)  # a group exists here
    except UnsupportedConfigError as exc:
        verdict = _decide(store, key, UnsupportedConfigError, f"rank {ctx.rank}: {exc}")
    else:
        verdict = _await_everyone(ctx, store, key, arrived, timeout, operation)
    kind, message = json.loads(verdict)
    if kind is not None:
        raise _ENTRY_ERRORS[kind](message)


def _await_everyone(ctx: DistContext, store: Any, key: str, arrived: int, timeout: float, operation: str) -> str:
    """The verdict of the call ``key``: every rank came, or a rank gave up waiting (this one or another)."""
    deadline, pause = time.monotonic() + timeout, 0.001
    while arrived < ctx.world_size:
        if store.check([f"{key}/verdict"]):
            return store.get(f"{key}/verdict").decode()
        if time.monotonic() > deadline:
            missing = [r for r in range(ctx.world_size) if not store.check([f"{key}/rank_{r}"])]
            return _decide(store, key, CheckpointError, (
                f"accelerator.{operation}() was called on rank {ctx.rank}, but rank(s) {missing} did not call it "
                f"within {timeout:.0f} s: call accelerator.{operation}() on every process, not under "
                f"`if accelerator.is_main_process:` (each process writes and reads its own part of the "
                f"checkpoint); if a process is only slower to get there, raise the process group's timeout "
                f"(InitProcessGroupKwargs(timeout=...)): this wait is half of it, or {ENTRY_TIMEOUT_ENV}=<seconds>"
            ))
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
        arrived = store.add(key, 0)
    return _decide(store, key, None, "")


def _decide(store: Any, key: str, kind: Optional[type], message: str) -> str:
    """Propose a verdict for ``key``; returns the one stored first (this one, or an earlier rank's)."""
    proposal = json.dumps([None if kind is None else kind.__name__, message])
    return store.compare_set(f"{key}/verdict", "", proposal).decode()


def agree(ctx: DistContext, work: Callable[[], T]) -> T:
    """``work()`` on this rank; if it raised on any rank, raise the same error on every rank.

    The error every rank raises is of the class of the lowest failing rank's exception (the nearest class
    every rank can build: the package's own errors and Python's built-in ones), names each failing rank with
    its message, and on a failing rank is chained to that rank's own exception. So an ``except`` around
    ``agree`` decides the same on every rank, and every rank makes the same collectives after it.

    ``work`` must not run a collective itself: a rank failing before it would leave the others there.
    """
    try:
        result, failure = work(), None
    except Exception as exc:  # re-raised below, on this rank and, through the gather, on every other
        result, failure = None, exc
    if not ctx.is_collective:
        if failure is not None:
            raise failure
        return result
    verdicts = ctx.all_gather(None if failure is None else _verdict(failure))
    failed = [(rank, verdict) for rank, verdict in enumerate(verdicts) if verdict is not None]
    if failed:
        raise _shared_error(failed) from failure
    return result


def _verdict(failure: Exception) -> dict:
    """What every rank needs to raise ``failure`` as its own: class path, message, plain attributes."""
    classes = [(c.__module__, c.__qualname__) for c in type(failure).__mro__ if issubclass(c, BaseException)]
    attributes = dict(vars(failure)) if type(failure).__module__.startswith(_PACKAGE) else {}
    try:
        pickle.dumps(attributes)
    except (pickle.PicklingError, TypeError, AttributeError):
        attributes = {}
    return {"classes": classes, "name": type(failure).__name__, "message": str(failure), "attributes": attributes}


def _shared_error(failed: list[tuple[int, dict]]) -> Exception:
    rank, first = failed[0]
    others = "".join(f"\nrank {r} failed too ({v['name']}): {v['message']}" for r, v in failed[1:])

    def message(kind: type) -> str:
        named = "" if first["name"] == kind.__name__ else f" ({first['name']})"
        return f"rank {rank} failed{named}: {first['message']}{others}"

    return rebuild(first, message)


def rebuild(verdict: dict, message: Callable[[type], str]) -> Exception:
    """The error of ``verdict`` (see :func:`_verdict`) on a rank that did not raise it, with ``message(class)``:
    its class where every rank can build it (the package's own errors and Python's built-in ones), else the
    nearest such base."""
    for kind in filter(None, map(_buildable, verdict["classes"])):
        text = message(kind)
        error = kind.__new__(kind)
        BaseException.__init__(error, text)
        error.__dict__.update(verdict["attributes"])
        if str(error) == text:  # a class whose message is more than its text (KeyError) takes its base
            return error
    raise AssertionError("unreachable: Exception itself is always buildable")


def _buildable(path: tuple[str, str]) -> Optional[type]:
    """The class at ``path`` where every rank has it (this package's, or a built-in), else ``None``."""
    module, name = path
    if module != "builtins" and not module.startswith(_PACKAGE):
        return None
    found = getattr(importlib.import_module(module), name, None) if "." not in name else None
    return found if isinstance(found, type) and issubclass(found, Exception) else None


_PACKAGE = "accelerate_stateful"
_ENTRY_ERRORS = {cls.__name__: cls for cls in (CheckpointError, UnsupportedConfigError)}


# --------------------------------------------------------------------------- numbering and leftovers
def same_everywhere(ctx: DistContext, value: Any, what: str) -> Any:
    """``value``, once every rank is known to hold the same; else the same refusal on every rank.

    For a choice that decides which collectives follow (automatic naming or an explicit folder), so that
    every rank makes the same ones.
    """
    everyone = ctx.all_gather(value)
    if any(v != everyone[0] for v in everyone[1:]):
        seen = ", ".join(f"rank {rank}: {v!r}" for rank, v in enumerate(everyone))
        raise UnsupportedConfigError(
            f"{what} differs between the processes ({seen}); make it the same on every process"
        )
    return value


def destination(ctx: DistContext, root: Optional[Path], output_dir: Any, iteration: int) -> tuple[Path, Optional[int]]:
    """Where ``save_state`` writes, marked as this package's: the next ``checkpoint_<N>`` under ``root``
    (automatic naming; ``N`` is returned too), else ``output_dir``; a leftover of an unfinished save of that
    number is removed. A foreign ``output_dir`` is refused on every rank, before anything is written."""
    def check() -> bool:
        if root is None and output_dir is None:
            raise ValueError("save_state() needs an output_dir when automatic_checkpoint_naming is off")
        return root is not None

    if not same_everywhere(ctx, agree(ctx, check), "ProjectConfiguration(automatic_checkpoint_naming=...)"):
        agree(ctx, lambda: _ownership.refuse_foreign(Path(output_dir), "save into"))
        mark(ctx, Path(output_dir))
        return Path(output_dir), None
    number = next_number(ctx, root, iteration)
    folder = root / f"checkpoint_{number}"
    clear_unfinished(ctx, folder)
    mark(ctx, folder)
    return folder, number


def newest_sealed(root: Path) -> int:
    """The number of the newest ``checkpoint_<N>`` under ``root`` that has a manifest, or -1."""
    return next((_files.checkpoint_number(p) for p in _files.numbered_checkpoints(root) if _files.has_manifest(p)),
                -1)


def next_number(ctx: DistContext, root: Path, iteration: int) -> int:
    """The number of the next automatic checkpoint: after the newest complete or foreign one any rank has
    (a folder of stock Accelerate, say), and not below ``iteration`` (``ProjectConfiguration.iteration``,
    which a user may set). Only a leftover of this package's own unfinished save may have that number."""
    newest = agree(ctx, lambda: max(newest_sealed(root), _ownership.newest_foreign(root)))
    return max([iteration] + [n + 1 for n in ctx.all_gather(newest)])


def clear_unfinished(ctx: DistContext, folder: Path) -> None:
    """Remove a leftover of a save killed before its manifest, in every folder that has one; never a sealed
    one, never a foreign one (``next_number`` chose a number past every foreign folder on every rank)."""
    def check() -> bool:
        _ownership.refuse_foreign(folder, "remove")
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


def mark(ctx: DistContext, folder: Path) -> None:
    """Write this package's marker into ``folder`` and unseal it (an earlier save's manifest removed) before
    anything else, in every folder the ranks save into: the main process's, then, for a folder it cannot see,
    the lowest rank that sees it. Every rank writes only after ``agree`` has heard from each of them."""
    agree(ctx, lambda: _claim(folder) if ctx.is_main else None)
    claimed = _ownership.marker(folder).is_file() and not _files.has_manifest(folder)
    seen = ctx.all_gather((claimed, socket.gethostname(), os.path.realpath(folder)))
    mine = seen[ctx.rank]
    first = next(r for r, s in enumerate(seen) if s == mine)
    agree(ctx, lambda: _claim(folder) if not mine[0] and first == ctx.rank else None)


def _claim(folder: Path) -> None:
    _ownership.write_marker(folder)
    if _files.unseal(folder):
        logger.warning("overwriting the checkpoint %s: it counts as incomplete until this save ends", folder)


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

    Every file of each folder is listed with its size and SHA-256: the processes that share a folder hash
    its files between them (each file once, the largest spread first), right after they were written.
    """
    save_id = ctx.broadcast(uuid.uuid4().hex)
    probe = folder / _files.SUBDIR / f".main.{save_id}"
    if ctx.is_main:  # the package's folder exists even where no loader state was written into it
        agree(ctx, lambda: (probe.parent.mkdir(parents=True, exist_ok=True), _files.write_atomic(probe, b"")))
    else:
        agree(ctx, lambda: None)
    # Which folder each rank wrote into: the main process's (it sees the probe), else its own.
    here = "main" if probe.exists() else (socket.gethostname(), os.path.realpath(folder))
    folders = ctx.all_gather(here)
    members = [r for r, f in enumerate(folders) if f == here]
    leader = members[0] == ctx.rank
    # Every file of the folder is hashed for its manifest, the files shared out between the processes that
    # wrote into it (their loader files were hashed as they were written); the leader takes their entries.
    position = members.index(ctx.rank) if ctx.rank in members else 0  # a simulated rank: no peers gathered
    mine = agree(ctx, lambda: _files.hash_share(folder, position, len(members), entries))
    shares = [found for f, found in zip(folders, ctx.all_gather(mine)) if f == here]
    hashed = {rel: entry for found in shares for rel, entry in found.items()}

    def write() -> None:
        if not leader:
            return
        _files.write_manifest(folder, world_size=ctx.world_size, num_loaders=num_loaders, ranks=members,
                              hashes=hashed, extra={"save_id": save_id})
        probe.unlink(missing_ok=True)
        if root is not None and keep is not None:
            rotate(root, keep=keep, just_written=folder)

    agree(ctx, write)


def rotate(root: Path, keep: int, just_written: Path) -> None:
    """Keep ``just_written`` and the newest complete checkpoints up to ``keep`` in all; remove older ones,
    and unfinished leftovers older than the oldest kept. Only this package's folders count, and only they
    are removed: a foreign one (stock Accelerate's, say) stays, whatever its number."""
    numbered = [p for p in _files.numbered_checkpoints(root) if _ownership.is_ours(p)]
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
