"""One launch of the elastic chain: resume the newest checkpoint on this world size, run to a stop, save.

Each batch trains a DDP model with gradient accumulation over 2 steps, and the stops fall inside an
accumulation window, so a rank that disagrees with the others on ``accelerator.step`` after an elastic
resume deadlocks the launch (the collective timeout ends it in a minute).

Run under ``accelerate launch`` by ``test_elastic_mp.py``:
``mp_elastic.py OUT_DIR LAUNCH NUM_WORKERS STOP_EPOCH STOP_BATCH`` (``STOP_EPOCH`` -1: run to the end).
Each rank appends ``{"launch", "epoch", "ids"}`` per batch to ``OUT_DIR/launch<L>.rank<R>.jsonl``, and
writes ``OUT_DIR/launch<L>.rank<R>.meta.json`` right after resuming: ``accelerator.step``, one draw of
``torch.rand`` and, on rank 0, its restored torch RNG state.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, ProjectConfiguration
from torch.utils.data import DataLoader

from accelerate_stateful import Accelerator

SAMPLES, BATCH_SIZE, EPOCHS, SEED, ACCUMULATION = 53, 3, 4, 5, 2


def make_loader(num_workers: int) -> DataLoader:
    return DataLoader(list(range(SAMPLES)), batch_size=BATCH_SIZE, shuffle=True, num_workers=num_workers,
                      generator=torch.Generator().manual_seed(SEED))


def main() -> None:
    out, launch, workers, stop_epoch, stop_batch = sys.argv[1], *map(int, sys.argv[2:6])
    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_steps=ACCUMULATION,
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
        project_config=ProjectConfiguration(project_dir=out, automatic_checkpoint_naming=True, total_limit=2),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=60))],
    )
    torch.manual_seed(100 + accelerator.process_index)  # what the RNGs hold before a checkpoint is loaded
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, dl = accelerator.prepare(model, optimizer, make_loader(workers))
    accelerator.resume()
    rank = accelerator.process_index
    meta = {"step": accelerator.step, "rng_state": torch.get_rng_state().tolist() if rank == 0 else None}
    meta["rand"] = torch.rand(1).item()
    (Path(out) / f"launch{launch}.rank{rank}.meta.json").write_text(json.dumps(meta))
    log = Path(out) / f"launch{launch}.rank{rank}.jsonl"
    with open(log, "w") as f:
        for epoch in range(dl.epoch, EPOCHS):
            for batch in dl:
                with accelerator.accumulate(model):
                    accelerator.backward(model(batch.float().unsqueeze(1)).pow(2).mean())
                    optimizer.step()
                    optimizer.zero_grad()
                f.write(json.dumps({"launch": launch, "epoch": epoch, "ids": batch.tolist()}) + "\n")
                if (epoch, dl.batches_yielded) == (stop_epoch, stop_batch):
                    f.flush()
                    accelerator.save_state()
                    return
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
