"""Launched on 2 processes by ``test_failures_mp.py``: a failure on one rank raises on every rank, and a save
with no loader of this package works as Accelerate's.

    ACCELERATE_USE_CPU=1 ACCELERATE_STATEFUL_ENTRY_TIMEOUT=3 ACCELERATE_STATEFUL_REPLY_TIMEOUT=3 \
        accelerate launch --multi_gpu --num_processes 2 tests/mp_failures.py OUT

Every ``load-*`` scenario writes a checkpoint with both ranks (a model whose weight is 1.0, a loader one
epoch in), then builds a fresh run (weight 0.0, loader at epoch 0) and makes ONE rank fail at one step of
``load_state``. Each rank then requires: the error is of the expected class, names the failing rank, and
is the same (class and message) on both ranks; and, where the step comes before anything is loaded, the
model, the loader, ``accelerator.step`` and torch's RNG are unchanged on both ranks.

Each rank writes ``OUT/rank<R>.json``: per scenario ``id``, ``passed``, ``detail`` and ``seconds`` (how long
the failing call took on that rank). The process group's collective timeout is 60 s, so a rank left in a
collective by the other fails the scenario instead of hanging the launch for 30 minutes.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import psutil
import torch
import torch.distributed as dist
from accelerate.state import PartialState
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
from torch.utils.data import DataLoader, Sampler

from accelerate_stateful import Accelerator
from accelerate_stateful.checkpoint import _files, _integrity
from accelerate_stateful.errors import CheckpointError, LifecycleError, StatefulLoaderError, StateMismatchError
import mp_harness_rank
from streams import CountingStream

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)


class Failed(Exception):
    pass


def check(condition: bool, what: str) -> None:
    if not condition:
        raise Failed(what)


def everyone(value: Any) -> list:
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


# --------------------------------------------------------------------------- a run to save and one to load
def make(project: Optional[Path] = None, automatic: bool = False) -> Accelerator:
    config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True) if automatic else None
    return Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
                       project_config=config)


def model_of(accelerator: Accelerator, weight: float) -> Any:
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(weight)
    return accelerator.prepare(model)


def prepared(accelerator: Accelerator, weight: float, batch_size: int = 2) -> tuple[Any, Any]:
    data = DataLoader(list(range(16)), batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(5))
    return model_of(accelerator, weight), accelerator.prepare(data)


def saved(folder: Path) -> Path:
    """A checkpoint in ``folder`` (one per rank where the path names the rank): weight 1.0, loader at epoch 1."""
    accelerator = make()
    model, dl = prepared(accelerator, 1.0)
    for _ in dl:
        pass
    return accelerator.save_state(folder)


def weight(model: Any) -> float:
    return float(model.module.weight.item())


def picture(accelerator: Accelerator, model: Any, dl: Any) -> dict:
    return {"weight": weight(model), "loader": json.dumps(dl.state_dict(), sort_keys=True, default=str),
            "step": accelerator.step, "rng": torch.get_rng_state().tolist()}


def expect_same_failure(run: Callable[[], Any], kind: type, failing: int,
                        named: Optional[str] = None) -> tuple[BaseException, float]:
    """Run ``run`` on this rank; it must raise ``kind`` naming rank ``failing`` (or ``named``, where any rank may
    be the one that finds the problem), the same on every rank."""
    started = time.monotonic()
    try:
        run()
        error: Optional[BaseException] = None
    except Exception as exc:
        error = exc
    seconds = time.monotonic() - started
    seen = everyone(None if error is None else (type(error).__name__, str(error)))
    check(error is not None, f"nothing raised on this rank; every rank saw {seen}")
    check(isinstance(error, kind), f"raised {type(error).__name__}, expected {kind.__name__}: {error}")
    named = named or f"rank {failing}"
    check(named in str(error), f"the error does not name {named}: {error}")
    check(all(s == seen[0] for s in seen), f"the ranks raised different errors: {seen}")
    return error, seconds


def one_rank_fails_at_load(out: Path, rank: int, kind: type, damage: Callable[[Path], None],
                           folder_per_rank: bool = True, batch_size: Callable[[int], int] = lambda r: 2,
                           nothing_loaded: bool = True, before_load: Callable[[Any, Any], None] = lambda a, d: None,
                           loader_unchanged: bool = True, named: Optional[str] = None) -> tuple[dict, float]:
    """Save, let rank 1 damage or change what it alone reads, and require the same refusal on both ranks."""
    checkpoint = saved(out / (f"rank{rank}" if folder_per_rank else "shared"))
    damaged = None
    try:
        if rank == 1:
            damage(checkpoint)
    except Exception as exc:  # raised after the barrier: both ranks leave the scenario at the same point
        damaged = exc
    dist.barrier()
    if damaged is not None:
        raise damaged
    accelerator = make()
    model, dl = prepared(accelerator, 0.0, batch_size(rank))
    before_load(accelerator, dl)
    before = picture(accelerator, model, dl)
    _, seconds = expect_same_failure(lambda: accelerator.load_state(checkpoint), kind, failing=1, named=named)
    after = picture(accelerator, model, dl)
    if nothing_loaded:
        changed = [key for key in before if before[key] != after[key]]
        check(not changed, f"changed on rank {rank} by a refused load: {changed}")
    check(not loader_unchanged or after["loader"] == before["loader"], f"the loader of rank {rank} changed")
    return after, seconds


# --------------------------------------------------------------------------- damage, by rank 1 only
def flip_a_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


def not_a_zip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[0:2] = b"XX"
    path.write_bytes(bytes(raw))


def resealed_garbage(checkpoint: Path) -> None:
    _files.state_file(checkpoint, 0, 1).write_text("{not json")
    manifest = _files.load_manifest(checkpoint)
    _files.write_manifest(checkpoint, world_size=2, num_loaders=1, ranks=[1], extra={"save_id": manifest["save_id"]})


# --------------------------------------------------------------------------- scenarios
def load_refused_by_one_ranks_loader(out: Path, rank: int) -> dict:
    _, seconds = one_rank_fails_at_load(out, rank, StateMismatchError, lambda c: None, folder_per_rank=False,
                                        batch_size=lambda r: 2 if r == 0 else 4)
    return {"seconds": seconds}


def load_with_a_loader_file_damaged_in_one_ranks_folder(out: Path, rank: int) -> dict:
    damage = lambda c: flip_a_byte(_files.state_file(c, 0, 1))  # noqa: E731
    _, seconds = one_rank_fails_at_load(out, rank, CheckpointError, damage)
    return {"seconds": seconds}


def load_with_a_loader_file_damaged_and_resealed_in_one_ranks_folder(out: Path, rank: int) -> dict:
    _, seconds = one_rank_fails_at_load(out, rank, CheckpointError, resealed_garbage)
    return {"seconds": seconds}


def load_with_accelerates_random_states_damaged_on_one_rank(out: Path, rank: int) -> dict:
    # A shared folder: the ranks split the hashing of its files by size (paths in the states change sizes), so the
    # rank that finds the damage is either; the error names the file.
    _, seconds = one_rank_fails_at_load(out, rank, CheckpointError, lambda c: not_a_zip(c / "random_states_1.pkl"),
                                        folder_per_rank=False, named="random_states_1.pkl")
    return {"seconds": seconds}


def load_with_the_model_missing_from_one_ranks_folder(out: Path, rank: int) -> dict:
    after, seconds = one_rank_fails_at_load(out, rank, FileNotFoundError, lambda c: None, nothing_loaded=False)
    check(after["weight"] == (1.0 if rank == 0 else 0.0), f"weight {after['weight']} on rank {rank}")
    return {"seconds": seconds, "weight after the refused load": after["weight"]}


def load_with_a_pre_hook_that_raises_on_one_rank(out: Path, rank: int) -> dict:
    def refuse(models: Any, input_dir: str) -> None:
        if rank == 1:
            raise ValueError("this hook refuses on rank 1")

    def hooked(accelerator: Accelerator, dl: Any) -> None:
        accelerator.register_load_state_pre_hook(refuse)

    _, seconds = one_rank_fails_at_load(out, rank, ValueError, lambda c: None, folder_per_rank=False,
                                        nothing_loaded=False, before_load=hooked)
    return {"seconds": seconds}


def load_while_one_rank_holds_a_live_iterator(out: Path, rank: int) -> dict:
    held = []

    def peek(accelerator: Accelerator, dl: Any) -> None:
        if rank == 1:
            held.append(iter(dl))
            next(held[0])

    _, seconds = one_rank_fails_at_load(out, rank, LifecycleError, lambda c: None, folder_per_rank=False,
                                        before_load=peek)
    held.clear()
    return {"seconds": seconds}


def a_late_rank_gets_the_entry_refusal(out: Path, rank: int) -> dict:
    accelerator = make()
    prepared(accelerator, 0.0)
    messages = {}
    for caller in (0, 1):
        if rank == caller:
            started = time.monotonic()
            try:
                accelerator.save_state(out / "refused")
            except CheckpointError as exc:
                messages[caller] = (str(exc), round(time.monotonic() - started, 2))
        dist.barrier()
    check(rank in messages, f"save_state() did not raise on rank {rank}")
    seen = everyone(messages[rank][0])
    check(seen[0] == seen[1], f"the ranks raised different refusals: {seen}")
    check("rank(s) [1] did not call it" in seen[0], seen[0])
    complete = accelerator.save_state(out / "together")
    check(_files.is_complete(complete), "the next save, on both ranks, is complete")
    return {"seconds on this rank": messages[rank][1]}


def resume_skips_a_checkpoint_refused_on_one_rank(out: Path, rank: int) -> dict:
    project = out / f"rank{rank}"
    data = lambda: DataLoader(list(range(16)), batch_size=2, shuffle=True,  # noqa: E731
                              generator=torch.Generator().manual_seed(5))
    accelerator = make(project, automatic=True)
    dl = accelerator.prepare(data())
    for _ in dl:
        pass
    accelerator.save_state()
    for _ in dl:
        pass
    newest = accelerator.save_state()
    if rank == 1:
        manifest_path = newest / _files.SUBDIR / _files.MANIFEST
        manifest = json.loads(manifest_path.read_text())
        manifest["files"] = {rel: 5 for rel in manifest["files"]}
        manifest[_integrity.CHECKSUM] = _integrity.checksum(manifest)  # consistent, as a faulty writer's would be
        manifest_path.write_text(json.dumps(manifest))
    dist.barrier()
    again = make(project, automatic=True)
    dl = again.prepare(data())
    try:
        verdict = f"resumed {again.resume().name}, loader at epoch {dl.epoch}"
    except Exception as exc:
        verdict = f"raised {type(exc).__name__}: {exc}"
    seen = everyone(verdict)
    check(seen[0] == seen[1], f"the ranks ended differently: {seen}")
    check(verdict == "resumed checkpoint_0, loader at epoch 1", verdict)
    return {"verdict": verdict}


def save_while_one_ranks_worker_does_not_answer(out: Path, rank: int) -> dict:
    config = DataLoaderConfiguration(use_stateful_dataloader=True, dispatch_batches=False)
    accelerator = Accelerator(dataloader_config=config)
    dl = accelerator.prepare(DataLoader(CountingStream(64), batch_size=2, num_workers=1))
    it = iter(dl)
    next(it), next(it)
    workers = psutil.Process().children() if rank == 1 else []
    for worker in workers:
        worker.suspend()
    try:
        error, seconds = expect_same_failure(lambda: accelerator.save_state(out / "refused"), StatefulLoaderError,
                                             failing=1)
    finally:
        for worker in workers:
            worker.resume()
    check("did not report its state within 3 s" in str(error), str(error))
    del it
    return {"seconds": seconds, "workers suspended": len(workers)}


class Unsized(Sampler):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def saves_without_a_loader_of_this_package(out: Path, rank: int) -> dict:
    plain = make()
    explicit = plain.save_state(out / "explicit")
    plain.load_state(explicit)
    first = make(out / "auto", automatic=True).save_state()
    for path in (explicit, first):
        manifest = _files.read_manifest(path)
        check(manifest["num_loaders"] == 0 and manifest["ranks"] == [0, 1], f"{path}: {manifest}")
    early = make(out / "auto", automatic=True)
    error, _ = expect_same_failure(early.resume, LifecycleError, failing=0)
    check("call it after" in str(error), f"resume() before prepare() says when to call it: {error}")

    model_only = make(out / "auto", automatic=True)
    model_of(model_only, 3.0)
    check(model_only.save_state().name == "checkpoint_1", "the numbering continues")

    untracked = make(out / "auto", automatic=True)
    model = model_of(untracked, 0.0)
    dl = untracked.prepare(DataLoader(list(range(16)), batch_size=2, sampler=Unsized(16)))
    check(not untracked.stateful_loaders, "a loader with an unsized sampler is left to Accelerate")
    check(untracked.resume().name == "checkpoint_1" and weight(model) == 3.0, "resumed the model-only save")
    it = iter(dl)
    head = [next(it).tolist()]
    third = untracked.save_state()
    rest = [b.tolist() for b in it]
    check(_files.read_manifest(third)["num_loaders"] == 0, "no loader state of this package")

    again = make(out / "auto", automatic=True)
    model_of(again, 0.0)
    dl = again.prepare(DataLoader(list(range(16)), batch_size=2, sampler=Unsized(16)))
    check(again.resume() == third, "resumed the save with the unsized loader")
    resumed = [b.tolist() for b in dl]
    check(resumed == rest, f"Accelerate's own state resumed the unsized loader at {resumed}, expected {rest}")
    return {"before the save": head, "after it": rest, "after the resume": resumed}


SCENARIOS = {
    "load-refused-by-one-ranks-loader": load_refused_by_one_ranks_loader,
    "load-loader-file-damaged-in-one-ranks-folder": load_with_a_loader_file_damaged_in_one_ranks_folder,
    "load-loader-file-damaged-and-resealed-in-one-ranks-folder":
        load_with_a_loader_file_damaged_and_resealed_in_one_ranks_folder,
    "load-accelerates-random-states-damaged-on-one-rank": load_with_accelerates_random_states_damaged_on_one_rank,
    "load-model-missing-from-one-ranks-folder": load_with_the_model_missing_from_one_ranks_folder,
    "load-pre-hook-raises-on-one-rank": load_with_a_pre_hook_that_raises_on_one_rank,
    "load-while-one-rank-holds-a-live-iterator": load_while_one_rank_holds_a_live_iterator,
    "entry-refusal-reaches-a-late-rank": a_late_rank_gets_the_entry_refusal,
    "save-while-one-ranks-worker-does-not-answer": save_while_one_ranks_worker_does_not_answer,
    "resume-skips-a-checkpoint-refused-on-one-rank": resume_skips_a_checkpoint_refused_on_one_rank,
    "save-without-a-loader-of-this-package": saves_without_a_loader_of_this_package,
}


def main() -> None:
    out = Path(sys.argv[1])
    only = sys.argv[2:] or list(SCENARIOS)
    state = PartialState(cpu=True, timeout=COLLECTIVE_TIMEOUT)
    torch.set_num_threads(1)
    results = []
    for name in only:
        mp_harness_rank.set_aside()
        dist.barrier()
        try:
            detail = SCENARIOS[name](out / name, state.process_index)
            results.append({"id": name, "passed": True, "detail": detail})
        except Exception as exc:  # recorded for the test to print, then every rank ends (mp_harness_rank.run)
            results.append({"id": name, "passed": False, "detail": f"{exc!r}\n{traceback.format_exc()}"})
            raise
        finally:
            (out / f"rank{state.process_index}.json").write_text(json.dumps(results, indent=1, default=str))
    dist.barrier()


if __name__ == "__main__":
    mp_harness_rank.run(main)
