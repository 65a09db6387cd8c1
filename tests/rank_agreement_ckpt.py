"""Two real processes under torchrun: a refusal on one rank raises on every rank, none waits (issue 25, items 7-10).

Usage (``test_rank_agreement_ckpt.py`` builds this command)::

    torchrun --standalone --nproc_per_node 2 tests/rank_agreement_ckpt.py OUT_DIR

Started without ``ACCELERATE_USE_CPU``, as a torchrun user on CPU would: the distributed context must follow
the process group, and refuse once Accelerate counts the processes otherwise; then Accelerate is set up for
CPU and the scenarios run, each expecting the same error on every rank. Each rank writes
``OUT_DIR/rank<R>.json``: ``{"checks": [...], "failures": [...]}``; the checks are the same on every rank.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import traceback
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable
from unittest import mock

os.environ.pop("ACCELERATE_USE_CPU", None)  # as under a plain torchrun; set again below, once it was tested

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from accelerate.state import PartialState  # noqa: E402
from accelerate.utils import DataLoaderConfiguration  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from accelerate_stateful import (Accelerator, CheckpointError, DistContext, ShardDataLoader,  # noqa: E402
                                 StateMismatchError, StateSerializationError, UnsupportedConfigError)
from accelerate_stateful.checkpoint import _files, _ownership  # noqa: E402
from accelerate_stateful.checkpoint.dcp import LoaderCheckpoint  # noqa: E402
from accelerate_stateful.integrations import _trainer_checkpoints  # noqa: E402
from accelerate_stateful.integrations.transformers import StatefulTrainerMixin  # noqa: E402
import mp_harness_rank  # noqa: E402


class Checks:
    def __init__(self) -> None:
        self.checks: list[str] = []
        self.failures: list[str] = []

    def expect(self, ok: bool, what: str, detail: str = "") -> None:
        (self.checks.append(what) if ok else self.failures.append(f"{what}: {detail}"))

    def refused(self, what: str, call: Callable[[], Any], kind: type, *fragments: str) -> None:
        """``call()`` must raise ``kind`` with every fragment in its message (on every rank alike)."""
        try:
            call()
        except kind as exc:
            missing = [f for f in fragments if f not in str(exc)]
            self.expect(not missing, what, f"{missing} not in {exc}")
        else:
            self.expect(False, what, "nothing was raised")


def loader(ctx: DistContext, samples: int = 12) -> ShardDataLoader:
    return ShardDataLoader.from_dataloader(DataLoader(list(range(samples)), batch_size=2), ctx)


def on_main(ctx: DistContext, error: Exception) -> Any:
    """``shutil.rmtree`` failing with ``error`` on the main process only."""
    return mock.patch("shutil.rmtree", side_effect=error) if ctx.is_main else contextlib.nullcontext()


def context(checks: Checks) -> DistContext:
    world = dist.get_world_size()
    found = DistContext.detect()  # Accelerate not set up yet: the process group's view
    checks.expect((found.rank, found.world_size) == (dist.get_rank(), world), "the context is the process group's",
                  f"{found}")
    PartialState()  # without ACCELERATE_USE_CPU on CPU, Accelerate takes each process for a lone one
    checks.refused("a single-process Accelerate under a process group of 2 is refused", DistContext.detect,
                   UnsupportedConfigError, "rank 0 of 1", f"of {world}", "ACCELERATE_USE_CPU=1")
    PartialState._reset_state()
    os.environ["ACCELERATE_USE_CPU"] = "1"
    PartialState(cpu=True)
    return DistContext.detect()


def dcp_refusals(ctx: DistContext, out: Path, checks: Checks) -> None:
    folder = out / "dcp"
    dcp.save({"dataloader": LoaderCheckpoint(loader(ctx))}, checkpoint_id=str(folder))
    other = LoaderCheckpoint(loader(ctx, samples=14 if ctx.rank == 1 else 12))
    checks.refused("a DCP load refused on rank 1 raises on every rank", lambda: dcp.load(
        {"dataloader": other}, checkpoint_id=str(folder)), StateMismatchError, "rank 1 failed", "len(dataset)")
    small = LoaderCheckpoint(loader(ctx, samples=400), capacity=128 if ctx.rank == 1 else 1 << 16)
    checks.refused("a state over capacity on rank 1 raises on every rank", lambda: dcp.save(
        {"dataloader": small}, checkpoint_id=str(out / "dcp_small")), StateSerializationError, "rank 1 failed",
        "capacity=128")


def overwritten_folder(ctx: DistContext, out: Path, checks: Checks) -> None:
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    accelerator.prepare(DataLoader(list(range(12)), batch_size=2))
    latest = out / "latest"
    accelerator.save_state(latest)
    killed = mock.patch.object(_files, "write_encoded", side_effect=RuntimeError("killed while writing"))
    with killed if ctx.rank == 1 else contextlib.nullcontext():
        checks.refused("a save killed on rank 1 raises on every rank", lambda: accelerator.save_state(latest),
                       RuntimeError, "rank 1 failed", "killed while writing")
    checks.refused("the folder it overwrote is refused as incomplete on every rank",
                   lambda: accelerator.load_state(latest), CheckpointError, "is incomplete")


def trainer_clean_up(ctx: DistContext, out: Path, checks: Checks) -> None:
    trainer = SimpleNamespace(accelerator=SimpleNamespace(is_main_process=ctx.is_main, wait_for_everyone=dist.barrier))
    leftover, complete = out / "run" / "checkpoint-2", out / "run" / "checkpoint-4"
    if ctx.is_main:
        for folder in (leftover, complete):
            _ownership.write_marker(folder)
            (folder / "model.safetensors").write_bytes(b"weights")
        _files.write_manifest(complete, world_size=ctx.world_size, num_loaders=0)
    dist.barrier()
    with on_main(ctx, PermissionError("read-only file system")):
        checks.refused("removing a leftover fails on the main process: every rank raises it",
                       lambda: StatefulTrainerMixin._clear_leftover(trainer, leftover), PermissionError,
                       "rank 0 failed", "read-only file system")
        checks.refused("rotating fails on the main process: every rank raises it",
                       lambda: _trainer_checkpoints.rotate_after_save(ctx, out / "run", 1, None, rotates=ctx.is_main),
                       PermissionError, "rank 0 failed", "read-only file system")
    StatefulTrainerMixin._clear_leftover(trainer, complete)
    kept = (complete / "model.safetensors").is_file() and not _files.has_manifest(complete)
    checks.expect(kept, "a complete checkpoint saved again is kept, unsealed", f"{sorted(complete.rglob('*'))}")


def main() -> None:
    out = Path(sys.argv[1])
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    checks = Checks()
    rank = dist.get_rank()
    try:
        ctx = context(checks)
        checks.expect((ctx.rank, ctx.world_size) == (rank, 2), "Accelerate on CPU and the process group agree", f"{ctx}")
        dcp_refusals(ctx, out, checks)
        overwritten_folder(ctx, out, checks)
        trainer_clean_up(ctx, out, checks)
    except Exception:  # recorded for the test to print, then every rank ends (mp_harness_rank.run)
        checks.failures.append(traceback.format_exc())
        raise
    finally:
        (out / f"rank{rank}.json").write_text(json.dumps(vars(checks), indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    mp_harness_rank.run(main)
