"""Reading a checkpoint on many processes: which one, verified once, merged once.

Each rank reads O(1) files of the package's own, whatever the world size:

- the manifest of its folder, and its own loader files, checked against the manifest from the bytes it
  reads (a rank never reads another rank's file to resume at the same world size);
- the whole folder (every file's size, every loader file's hash) is checked once per folder and host,
  by the lowest rank that reads it, and the verdict is shared;
- on another world size, the main process reads every saved rank's state, merges it, and sends each
  rank the merged state; that needs every saved rank's state in the main process's folder, and is
  refused with the reason where a folder holds only some ranks (node-local disks).

A step that can fail runs under :func:`_checkpoints.agree`, so every rank raises together.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from accelerate.utils import RNG_STATE_NAME
from accelerate.utils import load as accelerate_load

from .. import _log
from . import _files
from . import _refusals
from . import _state as S
from ._checkpoints import agree, same_everywhere
from .._context import DistContext
from ._versions import UnknownVersionError
from ..errors import CheckpointError

logger = _log.get_logger(__name__)


def locate(ctx: DistContext, input_dir: Any, root: Optional[Path]) -> tuple[Path, dict]:
    """The checkpoint ``load_state`` loads, with its manifest: ``input_dir``, else the newest complete one
    under ``root`` (automatic naming)."""
    def check() -> bool:
        if input_dir is None and root is None:
            raise ValueError("load_state() needs an input_dir when automatic_checkpoint_naming is off")
        return input_dir is None

    if not same_everywhere(ctx, agree(ctx, check), "load_state()'s input_dir being None"):
        return Path(input_dir), verify_once(ctx, Path(input_dir))
    found = agreed_latest(ctx, root)
    if found is None:
        raise CheckpointError(f"no complete checkpoint under {root}")
    return found


def verify_once(ctx: DistContext, checkpoint: Path) -> dict:
    """``checkpoint``'s manifest, every rank's; its folder fully checked (every file's size and hash) once per
    folder and host, by the ranks that read it, each a share of the files.

    Raises on every rank unless every rank's manifest belongs to one save (each rank may read a folder
    of its own): what follows (an elastic merge or not, how many loaders) is decided from it on each rank.
    """
    checkpoint = Path(checkpoint)
    manifest = agree(ctx, lambda: _files.load_manifest(checkpoint))
    key = (socket.gethostname(), os.path.realpath(checkpoint), manifest.get("save_id"), tuple(manifest["ranks"]))
    save = (manifest.get("save_id"), manifest["world_size"], manifest["num_loaders"])
    everyone = ctx.all_gather((key, save))
    if any(other != save for _, other in everyone):
        seen = "; ".join(f"rank {rank}: save {s[0]} of {s[1]} processes, {s[2]} loaders"
                         for rank, (_, s) in enumerate(everyone))
        raise CheckpointError(
            f"the processes read {checkpoint} from different saves ({seen}); each process reads a folder of its "
            "own, and they were not written by one save_state(); resume from a checkpoint every process saved "
            "together"
        )
    # Every file hashed once per folder and host, the files shared out between the ranks that read it.
    sharing = [r for r, (k, _) in enumerate(everyone) if k == key]
    share = (sharing.index(ctx.rank), len(sharing)) if ctx.rank in sharing else None
    agree(ctx, lambda: _files.verify_files(checkpoint, manifest, share) if share else None)
    return manifest


def agreed_latest(ctx: DistContext, root: Path) -> Optional[tuple[Path, dict]]:
    """The newest checkpoint under ``root`` complete on every rank (and from one save), with its manifest.

    Every rank makes the same collectives whatever its own folders hold: the candidates come from every
    rank's list, and a candidate refused on one rank (``verify_once`` raises the same error on every rank)
    is skipped on every rank.
    """
    mine = agree(ctx, lambda: _sealed(Path(root)))
    everyone = ctx.all_gather(mine)
    common = [n for n in sorted(everyone[0], reverse=True) if all(e.get(n) == everyone[0][n] for e in everyone)]
    for number in common:
        path = Path(root) / f"checkpoint_{number}"
        try:
            return path, verify_once(ctx, path)
        except CheckpointError as exc:
            if ctx.is_main:
                logger.warning("skipping %s: %s", path, exc)
    return None


def check_accelerate_files(ctx: DistContext, checkpoint: Path, manifest: dict) -> None:
    """Read the one file Accelerate's ``load_state`` reads for this rank alone, before anything is loaded.

    Accelerate skips a ``random_states_<rank>.pkl`` it cannot read with a log line, leaving that rank's
    random states and ``accelerator.step`` as they were: the ranks would then disagree on which step syncs
    gradients and wait for each other in ``backward``. Here such a file is refused on every rank. The ranks'
    steps are not compared: with ``even_batches=False`` a rank whose share of the epoch ended first has reset
    its step while the others count on (the manifest's hashes are what tie the files to one save).
    """
    name = f"{RNG_STATE_NAME}_{ctx.rank}.pkl"

    def read() -> None:
        if manifest["world_size"] != ctx.world_size or name not in manifest["files"]:
            return  # another world size: agree_after_elastic_load sets what the new ranks lack
        read_rng_file(Path(checkpoint) / name)

    agree(ctx, read)


def read_rng_file(path: Path) -> None:
    """Refuse a random-state file that Accelerate would skip (leaving the step and the RNG unrestored)."""
    try:
        states = accelerate_load(path)  # as Accelerate reads it
        missing = sorted({"random_state", "numpy_random_seed", "torch_manual_seed"} - set(states))
    except Exception as exc:  # whatever the unpickler raises: refused here with the file named
        raise CheckpointError(
            f"{path} cannot be read ({type(exc).__name__}: {exc}); Accelerate would skip it and leave this "
            "process's random states and step unrestored; resume from another checkpoint"
        ) from None
    if missing:
        raise CheckpointError(f"{path} lacks {missing}; resume from another checkpoint")


def _sealed(root: Path) -> dict[int, Optional[str]]:
    """Every ``checkpoint_<N>`` under ``root`` whose manifest this release reads: number -> save id."""
    found = {}
    for path in _files.numbered_checkpoints(root):
        try:
            found[_files.checkpoint_number(path)] = _files.load_manifest(path).get("save_id")
        except UnknownVersionError:
            raise  # written by a newer release: resuming from an older checkpoint instead would be silent
        except CheckpointError as exc:
            if _files.has_manifest(path):
                logger.warning("skipping %s: %s", path, exc)
    return found


def read_states(ctx: DistContext, checkpoint: Path, manifest: dict, loaders: Sequence[Any]) -> list[Any]:
    """This rank's state of every loader, read and validated before anything is loaded.

    At the saved world size each rank reads its own files. On another one (or where a loader needs every
    rank's state, e.g. another worker count for streams), the main process merges every saved rank's state
    and broadcasts it; each loader then re-derives its own cursor or refuses with the reason.
    """
    checkpoint = Path(checkpoint)
    same_world = manifest["world_size"] == ctx.world_size

    def own() -> list[Any]:
        _check_loader_count(checkpoint, manifest, loaders)
        if not same_world:
            return [None] * len(loaders)
        if ctx.rank not in manifest["ranks"]:
            raise CheckpointError(
                f"{checkpoint} does not hold the state of rank {ctx.rank}: the manifest of this folder lists ranks "
                f"{manifest['ranks']} (each node or process saved into a folder of its own); resume each process "
                "from the folder it saved into"
            )
        return [read_rank_state(checkpoint, manifest, index, ctx.rank) for index in range(len(loaders))]

    states = agree(ctx, own)
    shared = ctx.broadcast(agree(ctx, lambda: _main_states(ctx, checkpoint, manifest, loaders, states)))
    states = [shared[i] if i in shared else state for i, state in enumerate(states)]
    # Another batch size than the checkpoint's is resumed only if every process has it (each decides alone).
    sizes = ctx.all_gather([loader._config().get("batch_size") for loader in loaders])

    def validate() -> list[Any]:
        refusal = _refusals.order_refusal(
            states, lambda i, j: _refusals.fits(loaders[j], states[i]), lambda j: _refusals.describe(loaders[j]),
            checkpoint,
        )
        if refusal is not None:
            raise refusal
        for index, (loader, state) in enumerate(zip(loaders, states)):
            _refusals.uneven_batch_sizes([own[index] for own in sizes], loader, state,
                                         str(_files.state_file(checkpoint, index, ctx.rank)))
        for index, (loader, state) in enumerate(zip(loaders, states)):
            loader.validate_state(state, source=str(_files.state_file(checkpoint, index, ctx.rank)))
        return states

    return agree(ctx, validate)


def _main_states(ctx: DistContext, checkpoint: Path, manifest: dict, loaders: Sequence[Any],
                 own: list[Any]) -> dict[int, Any]:
    """On the main process: loader index -> the state every rank takes (merged, or rank 0's); else ``{}``."""
    if not ctx.is_main:
        return {}
    shared = {}
    for index, loader in enumerate(loaders):
        first = own[index] if own[index] is not None else read_rank_state(checkpoint, manifest, index, 0)
        state = shared_state(loader, own[index], first, lambda: [first] + [
            read_rank_state(checkpoint, manifest, index, r) for r in range(1, manifest["world_size"])])
        if state is not None:
            shared[index] = state
    return shared


def shared_state(loader: Any, own: Any, first: Any, every: Callable[[], list]) -> Any:
    """On the main process: the state every rank takes for ``loader`` (merged from ``every()`` saved rank's
    state, or rank 0's ``first`` where this rank has no ``own`` one), or ``None`` where each takes its own."""
    if loader.needs_all_ranks(first):
        return loader.merge_rank_states(every())
    return first if own is None else None


def read_rank_state(checkpoint: Path, manifest: dict, index: int, rank: int) -> Any:
    """Rank ``rank``'s state of loader ``index``, checked against the manifest, shape and topology."""
    if rank not in manifest["ranks"]:
        raise CheckpointError(
            f"cannot resume {checkpoint} on another number of processes: that needs the state of every rank it "
            f"was saved on (0 to {manifest['world_size'] - 1}), and this folder holds only ranks {manifest['ranks']} "
            f"(each node or process saved into a folder of its own); resume it on {manifest['world_size']} "
            "processes, each reading the folder it saved into (a resume on another number of processes needs a "
            "checkpoint saved into a folder every process shares)"
        )
    source = str(_files.state_file(checkpoint, index, rank))
    state = _files.read_loader_state(checkpoint, index, rank, manifest)
    S.check_shape(state, source)
    written = state[S.TOPOLOGY].get("world_size")
    if written != manifest["world_size"]:
        raise CheckpointError(
            f"{source} was written by world_size={written}, but {checkpoint / _files.SUBDIR / _files.MANIFEST} "
            f"says world_size={manifest['world_size']}; the checkpoint mixes files of different runs, resume from "
            "another checkpoint"
        )
    return state


def _check_loader_count(checkpoint: Path, manifest: dict, loaders: Sequence[Any]) -> None:
    # More states than loaders: the rest wait for the loaders prepared later (``_pending``).
    if manifest["num_loaders"] < len(loaders):
        raise CheckpointError(
            f"{checkpoint} holds {manifest['num_loaders']} loader states, this run prepared {len(loaders)} "
            "stateful loaders; prepare the same loaders in the same order as the run that saved it"
        )
