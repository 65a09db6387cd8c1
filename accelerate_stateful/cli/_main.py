"""``accelerate-stateful``: look inside a checkpoint's loader state (also ``python -m accelerate_stateful``).

Commands: ``inspect``, ``verify``, ``samples``, ``diff`` (see ``docs/cli.md``). Exit codes:

==  ==========================================================================
0   done; for ``inspect`` and ``verify``: the checkpoint is complete and intact
1   the checkpoint is incomplete or damaged: ``verify`` prints each problem with
    its file and the fix; ``inspect`` prints what it could read, and the first
    problem on stderr
2   bad arguments, or a loader, rank or step the checkpoint does not have
3   the input cannot be read: a missing path, a folder that is not a checkpoint,
    a format written by a newer release, a loader state a resume would refuse,
    ``samples`` of an incomplete checkpoint
4   the question does not apply to this loader (``samples`` of a stream, or of
    an order drawn by a user's own sampler)
5   ``verify``: complete, but some files could only be checked for their size:
    the release that wrote the checkpoint did not hash them
==  ==========================================================================

``inspect``, ``verify`` and ``diff`` read JSON and safetensors headers only and never import torch (nor
accelerate): a call takes a fraction of a second. So does ``samples`` of a shard loader or a dispatcher whose
order is sequential or ``shuffle=True`` (``_indices``, ``_dispatched``); beyond that (a shard loader's epoch above
4,000,000 samples, an order drawn by a user's own sampler, which it refuses) it rebuilds the loaders, and so
imports them and torch.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from ..checkpoint import _integrity
from ..checkpoint import _state as S
from . import _check_resume, _composed, _dispatched, _filtered, _indices, _packed, _streams
from ._position import with_reader
from ._diff import diff_reports, format_diff
from ._read import (Checkpoint, NotAnswerable, Problem, UnreadableCheckpoint, open_checkpoint,
                    require_drawable_order, require_map_style)
from ._report import SCHEMA_VERSION, describe, format_report
from ..errors import StatefulLoaderError

OK, PROBLEMS, USAGE, UNREADABLE, NOT_APPLICABLE, SIZE_ONLY = 0, 1, 2, 3, 4, 5


class _UsageError(Exception):
    """A loader, rank or step that the checkpoint does not have."""


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except _UsageError as exc:
        return _fail(str(exc), USAGE)
    except NotAnswerable as exc:
        return _fail(str(exc), NOT_APPLICABLE)
    except StatefulLoaderError as exc:  # UnreadableCheckpoint, and a state the loader itself refuses
        return _fail(str(exc), UNREADABLE)
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as the Python docs advise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return OK


def _fail(message: str, status: int) -> int:
    print(f"accelerate-stateful: error: {' '.join(message.split())}", file=sys.stderr)
    return status


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="accelerate-stateful", description="Look inside the loader state of an accelerate-stateful checkpoint.",
        epilog="exit codes: 0 ok, 1 incomplete or damaged checkpoint, 2 bad arguments, 3 unreadable input, "
               "4 question does not apply to this loader, 5 (verify) some files of an earlier release's checkpoint "
               "checked for size only",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    inspect = commands.add_parser("inspect", help="completeness, versions, topology and every loader's position")
    inspect.add_argument("checkpoint", type=Path, metavar="CKPT")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON (schema in docs/cli.md)")
    inspect.set_defaults(run=_inspect)
    verify = commands.add_parser("verify", help="exit 0 only if every byte of the checkpoint is as its save wrote it")
    verify.add_argument("checkpoint", type=Path, metavar="CKPT")
    verify.set_defaults(run=_verify)
    samples = commands.add_parser("samples", help="dataset indices a rank consumed, reads next, or reads at a step")
    samples.add_argument("checkpoint", type=Path, metavar="CKPT")
    samples.add_argument("--loader", type=int, default=0, metavar="I", help="which prepared loader (default 0)")
    samples.add_argument("--rank", type=int, metavar="R", help="one rank (default: every rank)")
    what = samples.add_mutually_exclusive_group(required=True)
    what.add_argument("--consumed", action="store_true", help="batches taken in the checkpoint's epoch")
    what.add_argument("--remaining", action="store_true", help="batches a resume reads in the rest of the epoch")
    what.add_argument("--step", type=int, metavar="N", help="the rank's batch number N of the epoch (from 0)")
    samples.add_argument("--world-size", type=int, metavar="W",
                         help="with --remaining: what each of W processes reads after an elastic resume")
    samples.add_argument("--json", action="store_true", help="print the batches as JSON")
    samples.set_defaults(run=_samples)
    diff = commands.add_parser("diff", help="what changed between two checkpoints of a run")
    diff.add_argument("a", type=Path, metavar="CKPT_A")
    diff.add_argument("b", type=Path, metavar="CKPT_B")
    diff.add_argument("--json", action="store_true", help="print the changes as JSON")
    diff.set_defaults(run=_diff)
    _check_resume.register(commands)
    return parser


def _print(value: object, as_json: bool, text: str) -> None:
    print(json.dumps(value, indent=1, sort_keys=True) if as_json else text)


# --------------------------------------------------------------------------- commands
def _inspect(args: argparse.Namespace) -> int:
    ckpt = open_checkpoint(args.checkpoint)
    report = describe(ckpt)
    _print(report, args.json, format_report(report))
    if not ckpt.complete:  # what could be read is shown; the status says a resume would refuse it
        return _fail(_incomplete(ckpt), PROBLEMS)
    return OK


def _incomplete(ckpt: Checkpoint) -> str:
    """The first problem of an incomplete checkpoint, naming the checkpoint once, and how to see the rest."""
    message = ckpt.problems[0].message
    if str(ckpt.path) not in message:
        message = f"{ckpt.path} is incomplete or damaged: {message}"
    more = len(ckpt.problems) - 1
    return message + (f" ({more} more: 'accelerate-stateful verify {ckpt.path}' lists every problem)" if more else "")


def _verify(args: argparse.Namespace) -> int:
    ckpt = open_checkpoint(args.checkpoint, hashes=True)
    if ckpt.complete:
        try:
            describe(ckpt)  # every state resumed into its loader: the checks a resume makes
        except UnreadableCheckpoint as exc:
            ckpt.problems.append(Problem(None, str(exc)))
    if not ckpt.complete:
        for problem in ckpt.problems:
            print(f"PROBLEM {problem.file or ckpt.path}: {' '.join(problem.message.split())}")
        print(f"INCOMPLETE {ckpt.path}: {len(ckpt.problems)} problem(s); resume from another checkpoint "
              "(accelerator.resume() skips incomplete ones)")
        return PROBLEMS
    files, unhashed = len(ckpt.manifest["files"]), _integrity.unhashed(ckpt.manifest)
    topology = f"world size {ckpt.world_size}, {ckpt.num_loaders} loader(s)"
    if unhashed:  # never called good: a changed byte in them would not show
        for name in unhashed:
            print(f"UNCHECKED {name}: its size matches, but the release that wrote this checkpoint did not record "
                  "its hash, so a changed byte would not show")
        print(f"SIZE ONLY {ckpt.path}: complete, {files - len(unhashed)} of {files} files match their size and "
              f"hash, {len(unhashed)} could only be checked for their size: not hashed by the version that wrote "
              f"it ({topology}); checkpoints saved from now on are hashed whole")
        return SIZE_ONLY
    print(f"OK {ckpt.path}: complete, all {files} files match their size and SHA-256 in the manifest ({topology})")
    return OK


def _diff(args: argparse.Namespace) -> int:
    a, b = open_checkpoint(args.a), open_checkpoint(args.b)
    change = diff_reports(describe(a), describe(b))
    _print(change, args.json, format_diff(change))
    broken = next((c for c in (a, b) if not c.complete), None)
    if broken is not None:  # compared as far as it could be read; a resume would refuse it
        return _fail(_incomplete(broken), PROBLEMS)
    return OK


def _samples(args: argparse.Namespace) -> int:
    ckpt = open_checkpoint(args.checkpoint)
    if not ckpt.complete:
        raise UnreadableCheckpoint(
            f"{_incomplete(ckpt)}; a resume never reads it, so its samples mean nothing: run "
            "'accelerate-stateful verify' on it, or pick another checkpoint"
        )
    if not 0 <= args.loader < ckpt.num_loaders:
        raise _UsageError(f"--loader {args.loader}: the checkpoint has {ckpt.num_loaders} loader(s), numbered from 0")
    states = ckpt.rank_states(args.loader)
    world = ckpt.world_size if args.world_size is None else args.world_size
    if world < 1 or (world != ckpt.world_size and not args.remaining):
        raise _UsageError(f"--world-size {world} needs --remaining and a count of at least 1: after an elastic "
                          "resume nothing is consumed yet, only the rest of the epoch is read")
    ranks = range(world) if args.rank is None else [args.rank]
    if not all(0 <= r < world for r in ranks):
        raise _UsageError(f"--rank {args.rank}: the {'resumed run' if args.world_size else 'checkpoint'} has "
                          f"{world} rank(s), numbered from 0")
    if _streams.is_composed(with_reader(states, 0)):
        return _composed_samples(ckpt, states, ranks, world, args)
    require_map_style(with_reader(states, 0))
    if not all(_derivable(states, r, world) for r in ranks):  # the loaders, rebuilt, take the tensors
        states = open_checkpoint(args.checkpoint, with_tensors=True).rank_states(args.loader)
    found = [_rank_samples(states, r, world, args) for r in ranks]
    out = {"schema_version": SCHEMA_VERSION, "checkpoint": str(ckpt.path), "loader": args.loader,
           "epoch": states[0][S.EPOCH], "world_size": world, "elastic": world != ckpt.world_size,
           "ranks": found}
    _print(out, args.json, _format_samples(out))
    return OK


def _rank_samples(states: list, rank: int, world: int, args: argparse.Namespace) -> dict:
    """One rank's batches for the question asked."""
    taken, total, epoch, batches_between = _answerer(states, rank, world)
    if args.step is not None and not 0 <= args.step < total:
        raise _UsageError(f"--step {args.step}: rank {rank} has {total} batches in epoch {epoch} "
                          f"(steps 0 to {total - 1})")
    if args.consumed:
        start, stop = 0, taken
    elif args.remaining:
        start, stop = taken, None
    else:
        start, stop = args.step, args.step + 1
    batches = batches_between(start, stop)
    origin = states[rank].get(S.STRIPE_ORIGIN, 0) if world == len(states) else 0
    return {"rank": rank, "batches_taken": taken, "batches_in_epoch": total, "stripe_origin": origin,
            "batches": [{"step": start + k, "indices": b} for k, b in enumerate(batches)]}


def _derivable(states: list, rank: int, world: int) -> bool:
    """Whether ``rank``'s batches follow from the states without torch (:func:`_answerer`)."""
    return _indices.answerable(states, rank, world) or _dispatched.answerable(states, rank, world)


def _answerer(states: list, rank: int, world: int) -> tuple[int, int, int, Callable[[int, Optional[int]], list]]:
    """(batches taken, batches in the epoch, epoch, ``batches(start, stop)``) of ``rank`` of ``world`` resumed
    from the checkpoint: a shard loader's or a dispatcher's from the states (``_indices``, ``_dispatched``,
    without torch), any other's from the loader rebuilt and resumed (``_loaders``, which imports torch)."""
    if _indices.answerable(states, rank, world):
        state = _indices.resumed_state(states, rank, world)
        plan, taken, epoch = _indices.rank_position(state, rank, world)
        return taken, plan.num_batches, epoch, functools.partial(_indices.rank_batches, state, plan, epoch)
    if _dispatched.answerable(states, rank, world):
        found = _dispatched.layout(states, rank, world)
        return found.taken, found.total, found.epoch, functools.partial(_dispatched.batches, found)
    require_drawable_order(states)  # refused from the states, before torch is imported for the loaders
    from ._loaders import restored_loader, resumed_batches

    loader = restored_loader(states, rank, world)
    return (loader.batches_yielded, len(loader), loader.epoch,
            functools.partial(resumed_batches, states, rank, world))


def _composed_samples(ckpt: Checkpoint, states: list, ranks: Sequence[int], world: int,
                      args: argparse.Namespace) -> int:
    """``samples`` of a stream over a composable source: each taken step's samples as (source, document)."""
    if args.remaining or world != ckpt.world_size:
        raise NotAnswerable(
            "a stream's steps after the checkpoint depend on when its sources run out, and the checkpoint does not "
            "record their lengths; ask for the steps taken: --consumed, or --step N below the steps taken"
        )
    found = []
    for rank in ranks:
        layout = _streams.layout(with_reader(states, rank), world)
        if args.step is not None and not 0 <= args.step < layout.taken:
            if args.step < 0:
                raise _UsageError(f"--step {args.step}: steps are numbered from 0")
            raise NotAnswerable(
                f"--step {args.step}: rank {rank} had taken {layout.taken} steps of epoch {layout.epoch} at this "
                "checkpoint, and what a stream's later steps hold depends on when its sources run out, which the "
                f"checkpoint does not record; ask for a step from 0 to {layout.taken - 1}, or --consumed"
            )
        steps = range(layout.taken) if args.consumed else [args.step]
        marked = next((by for kind, by in ((_composed.is_packed, _packed.step_pieces),
                                           (_composed.is_filtered, _filtered.step_draws))
                       if any(kind(anchor) for anchor in layout.anchors)), None)
        if marked is not None:  # named from the marks of the outermost source
            datasets = [None if snap is None else snap["dataset"]
                        for snap in _streams.reader_stream(with_reader(states, rank))["snapshots"]]
            batches = [dict(marked(layout, datasets, step), step=step) for step in steps]
        else:
            items = [_streams.step_items(layout, step) for step in steps]
            named = iter(_composed.name_items(list(layout.anchors), [k for ks in items for k in ks], layout.epoch))
            batches = [{"step": step, "indices": ks, "samples": [dict(next(named), index=k) for k in ks]}
                       for step, ks in zip(steps, items)]
        found.append({"rank": rank, "batches_taken": layout.taken, "batches_in_epoch": None, "stripe_origin": 0,
                      "batches": batches})
    out = {"schema_version": SCHEMA_VERSION, "checkpoint": str(ckpt.path), "loader": args.loader,
           "epoch": states[0][S.EPOCH], "world_size": world, "elastic": False, "ranks": found}
    _print(out, args.json, _format_samples(out))
    unknown = [s["unknown"] for r in found for b in r["batches"]
               for s in [*b.get("samples", ()), *b.get("pieces", ()), *b.get("drawn", ()),
                         *b.get("between", {}).get("drawn", ())] if s.get("unknown")]
    return _fail(unknown[0], NOT_APPLICABLE) if unknown else OK


def _format_samples(out: dict) -> str:
    lines = []
    for rank in out["ranks"]:
        elastic = " after an elastic resume" if out["elastic"] else ""
        of = "" if rank["batches_in_epoch"] is None else f" of {rank['batches_in_epoch']}"
        lines.append(f"# loader {out['loader']}, rank {rank['rank']} of {out['world_size']}{elastic}, epoch "
                     f"{out['epoch']}: {rank['batches_taken']}{of} batches taken")
        if rank["batches_in_epoch"] is None and any("pieces" in b for b in rank["batches"]):
            lines.append("# each step's packed rows as the pieces of documents they were cut from, "
                         "source:document[start:stop] (token offsets; whole documents without them)")
            if any("between" in b for b in rank["batches"]):
                lines.append("# the documents are the items a Filtered kept, each named by the source item it was "
                             "where the checkpoint tells; [K of ...]: K whole documents, the items the Filtered "
                             "kept among the source items listed, in the order drawn; which of them were kept is "
                             "the predicate's decision: run it on them to tell")
        elif rank["batches_in_epoch"] is None and any("drawn" in b for b in rank["batches"]):
            lines.append("# each step's rows are the items its Filtered kept among the source items it drew for them, "
                         "listed here as source:document in the order drawn; which of them were kept is the "
                         "predicate's decision: run it on them to tell")
        elif rank["batches_in_epoch"] is None:
            lines.append("# each sample as source:document (the document's index in that source's order this "
                         "epoch; (item N): its N-th item this epoch, where the checkpoint cannot tell which document)")
        if rank["stripe_origin"]:
            lines.append(f"# steps count from sample {rank['stripe_origin']} of the epoch: the samples before it "
                         "were taken on another number of processes")
        lines += [_step_line(b) for b in rank["batches"]]
    return "\n".join(lines)


def _step_line(batch: dict) -> str:
    """A step of ``samples``: its samples, the pieces of its packed rows, or what its filter drew for it."""
    if "pieces" in batch:
        return f"step {batch['step']} ({batch['rows']}): {' '.join(_pieces(batch))}"
    if "drawn" in batch:
        return (f"step {batch['step']} ({batch['rows']}): {batch['kept']} kept, {batch['dropped']} dropped of "
                f"{len(batch['drawn'])} drawn: {' '.join(_piece(dict(d, start=0, stop=None)) for d in batch['drawn'])}")
    return f"step {batch['step']}: {' '.join(_shown(batch, i) for i in range(len(batch['indices'])))}"


def _pieces(batch: dict) -> list[str]:
    """A packed step's pieces; below a filter, ``[K of ...]`` for the documents kept among the items drawn
    between the ones named (where some of those were dropped)."""
    shown = [_piece(p) for p in batch["pieces"] if not p.get("between")]
    between = batch.get("between")
    if between and between["dropped"]:
        drawn = " ".join(_piece(dict(d, start=0, stop=None)) for d in between["drawn"])
        at = 1 if batch["pieces"][0]["start"] else 0  # after a first document begun in an earlier step
        shown.insert(at, f"[{between['kept']} of {drawn}]")
    return shown


def _piece(piece: dict) -> str:
    """A piece of a document a packed step holds: ``source:document``, with its token span where partial."""
    document = piece["document"] if piece["document"] is not None else f"(item {piece['item']})"
    span = "" if piece["start"] == 0 and piece["stop"] is None else \
        f"[{piece['start'] or ''}:{'' if piece['stop'] is None else piece['stop']}]"
    return f"{document}{span}" if piece["source"] is None else f"{piece['source']}:{document}{span}"


def _shown(batch: dict, i: int) -> str:
    """A sample of a batch: its dataset index, or for a composable source ``source:document``."""
    if "samples" not in batch:
        return str(batch["indices"][i])
    sample = batch["samples"][i]
    document = sample["document"] if sample["document"] is not None else f"(item {sample['item']})"
    return str(document) if sample["source"] is None else f"{sample['source']}:{document}"
