"""Loader positions through ``torch.distributed.checkpoint`` on real processes; run under torchrun.

Usage (``test_dcp.py`` builds this command)::

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dcp_scenarios.py OUT_DIR

Torchtitan style: plain ``torch.distributed`` on gloo, no Accelerator. Each rank
holds two loaders checkpointed together by one ``LoaderCheckpoint``: a shuffled
map-style loader that drives the loop, and a stateful iterable stream (whose
state tree changes shape once it has started), advanced one batch per step and
restarted when it runs out, so the two are at unrelated positions when a
checkpoint is taken. No worker processes: DCP does not see them, and forking
them costs more time here than the rest of the launch.

For every save point each rank runs:

1. a *saver* from the start to the save point, ``dcp.save`` of the model and
   the loaders there (every rank into the same folder);
2. a *resumer*: new loaders, the ``LoaderCheckpoint`` built before the first
   batch (the template DCP loads into), ``dcp.load``, run to the end; the batches
   before the save plus those after must equal the uninterrupted run.

It also checks that ``state_dict()`` has the same structure before and after
iteration started, that the checkpoint holds every rank's key, and that a
checkpoint loaded into loaders over another dataset is refused on every rank.
Each rank writes ``OUT_DIR/rank<R>.json``: ``{"checks": [...], "failures": [...], "round_trips": N}``.
"""

from __future__ import annotations

import datetime
import json
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))

from accelerate_stateful import DistContext, IterableShardDataLoader, ShardDataLoader, StateMismatchError  # noqa: E402
from accelerate_stateful.checkpoint.dcp import LoaderCheckpoint  # noqa: E402
import mp_harness_rank  # noqa: E402
from harness import batch_ids  # noqa: E402
from streams import CountingStream  # noqa: E402

EPOCHS = 2
MAP_SAMPLES, STREAM_SAMPLES, BATCH = 23, 13, 2
# Save points as (batches taken, where), an epoch being 6 steps: before the first batch, mid-epoch, on
# the epoch's last batch inside the loop, after the epoch's loop ended, mid second epoch, after the last.
SAVE_POINTS = [(0, "in_loop"), (3, "in_loop"), (6, "in_loop"), (6, "after_loop"), (9, "in_loop"),
               (12, "in_loop")]


def make_loaders(ctx: DistContext, batch_size: int = BATCH, samples: int = MAP_SAMPLES) -> list:
    main = DataLoader(list(range(samples)), batch_size=batch_size, shuffle=True,
                      generator=torch.Generator().manual_seed(5))
    aux = DataLoader(CountingStream(STREAM_SAMPLES), batch_size=batch_size)
    return [ShardDataLoader.from_dataloader(main, ctx), IterableShardDataLoader.from_dataloader(aux, ctx)]


def structure(state: dict) -> dict:
    return {rank: {name: (str(t.dtype), tuple(t.shape)) for name, t in buffers.items()}
            for rank, buffers in state.items()}


def drive(loaders: list, stop: Optional[tuple[int, str]] = None, taken: int = 0,
          on_stop: Any = None) -> list[list]:
    """The loop: one batch of the main loader and one of the stream per step; calls ``on_stop`` at ``stop``."""
    main, aux = loaders
    steps: list[list] = []
    aux_it = iter(aux)

    def aux_next() -> tuple:
        nonlocal aux_it
        for _ in range(2):
            try:
                return batch_ids(next(aux_it))
            except StopIteration:
                aux_it = iter(aux)
        raise RuntimeError("the stream yielded nothing in a whole epoch")

    if stop in ((taken, "in_loop"), (taken, "before")):
        on_stop()
        return steps
    for epoch in range(main.epoch, EPOCHS):
        for batch in main:
            steps.append([epoch, list(batch_ids(batch)), list(aux_next()), bool(main.end_of_dataloader)])
            if stop == (taken + len(steps), "in_loop"):
                on_stop()
                return steps
        if stop == (taken + len(steps), "after_loop"):
            on_stop()
            return steps
    return steps


def model_state(value: float) -> dict:
    return {"weight": torch.full((4,), value)}


class Checks:
    def __init__(self) -> None:
        self.checks: list[str] = []
        self.failures: list[str] = []
        self.round_trips = 0

    def expect(self, ok: bool, what: str) -> None:
        (self.checks if ok else self.failures).append(what)


def round_trip(ctx: DistContext, out: Path, reference: list, point: tuple, index: int, checks: Checks) -> Path:
    folder = out / f"ckpt_{index}"
    saver = make_loaders(ctx)
    template = structure(LoaderCheckpoint(saver).state_dict())

    def save() -> None:
        ckpt = LoaderCheckpoint(saver)
        checks.expect(structure(ckpt.state_dict()) == template, f"{point}: state_dict() kept its structure")
        dcp.save({"model": model_state(float(index)), "dataloader": ckpt}, checkpoint_id=str(folder))

    before = drive(saver, point, on_stop=save)
    resumed = make_loaders(ctx)
    state = {"model": model_state(-1.0), "dataloader": LoaderCheckpoint(resumed)}  # before the first batch
    dcp.load(state, checkpoint_id=str(folder))
    checks.expect(torch.equal(state["model"]["weight"], torch.full((4,), float(index))), f"{point}: model loaded")
    after = drive(resumed, taken=len(before))
    seen = before + after
    same = seen == reference
    detail = "" if same else next(
        (f" first difference at step {i}: expected {w}, got {g}" for i, (w, g) in enumerate(zip(reference, seen))
         if w != g), f" {len(seen)} steps, expected {len(reference)}")
    checks.expect(same, f"{point}: resumed run equals the uninterrupted one on rank {ctx.rank}.{detail}")
    checks.round_trips += 1
    return folder


def main() -> None:
    out = Path(sys.argv[1])
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    ctx = DistContext(rank=dist.get_rank(), world_size=dist.get_world_size())
    checks = Checks()
    try:
        reference = drive(make_loaders(ctx))
        folder = None
        for index, point in enumerate(SAVE_POINTS):
            folder = round_trip(ctx, out, reference, point, index, checks)
        if ctx.rank == 0:
            keys = set(FileSystemReader(str(folder)).read_metadata().state_dict_metadata)
            wanted = {f"dataloader.rank_{r}.loader_{i}" for r in range(ctx.world_size) for i in range(2)}
            checks.expect(wanted <= keys, f"the checkpoint holds every rank's keys: {sorted(keys)}")
        other = LoaderCheckpoint(make_loaders(ctx, samples=MAP_SAMPLES + 1))
        try:
            dcp.load({"dataloader": other}, checkpoint_id=str(folder))
            checks.expect(False, "a checkpoint for another dataset length was accepted")
        except StateMismatchError as exc:
            expected = f"len(dataset): saved {MAP_SAMPLES}, current {MAP_SAMPLES + 1}"
            checks.expect(expected in str(exc), f"another dataset is refused: {exc}")
    except Exception:  # recorded for the test to print, then every rank ends (mp_harness_rank.run)
        checks.failures.append(traceback.format_exc())
        raise
    finally:
        (out / f"rank{ctx.rank}.json").write_text(json.dumps(vars(checks), indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp_harness_rank.run(main)
