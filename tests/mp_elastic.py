"""One launch of the elastic chain: resume the newest checkpoint on this world size, run to a stop, save.

Run under ``accelerate launch`` by ``test_elastic_mp.py``:
``mp_elastic.py OUT_DIR LAUNCH NUM_WORKERS STOP_EPOCH STOP_BATCH`` (``STOP_EPOCH`` -1: run to the end).
Every source of ``SOURCES`` runs in turn, each with its own ``Accelerator`` and project folder
``OUT_DIR/<source>``; a run stops after its ``STOP_BATCH``-th batch of epoch ``STOP_EPOCH`` in this launch.
Each rank appends ``{"launch", "epoch", "ids"}`` per batch to ``OUT_DIR/launch<L>.<source>.rank<R>.jsonl``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
from torch.utils.data import DataLoader, IterableDataset, Sampler, get_worker_info

from accelerate_stateful import Accelerator
from streams import CountingStream

SAMPLES, BATCH_SIZE, EPOCHS, SEED = 53, 3, 4, 5
# map: map-style data, each rank its shard; batch-sampler: a user's shuffled batch_sampler of varying batch
# sizes, without workers (test_multiprocess runs it with two); stream: a stateful stream every rank reads whole
# (dispatch_batches=False), read by one worker whenever the chain has workers (the worker count of such a
# stream may not change; 0 and 1 both read it whole); recipe: torch's worker_init_fn sharding recipe under the
# default dispatcher, an opaque stream fast-forwarded on resume, two persistent workers throughout. An opaque
# stream read whole is rescaled in-process only (test_replicated_elastic.py): it resumes as the recipe does.
SOURCES = ("map", "batch-sampler", "stream", "recipe")


class VaryingBatches(Sampler):
    """Batches of 1, 2, 3, 4, 1, … ids of a permutation drawn from its own generator."""

    def __init__(self, n: int) -> None:
        self.n, self.generator = n, torch.Generator().manual_seed(SEED)

    def __iter__(self):
        order, start, size = torch.randperm(self.n, generator=self.generator).tolist(), 0, 1
        while start < self.n:
            yield order[start:start + size]
            start, size = start + size, size % 4 + 1

    def __len__(self) -> int:
        return self.n


class RangeStream(IterableDataset):
    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end

    def __iter__(self):
        return iter(range(self.start, self.end))


def split_range(worker_id: int) -> None:
    """The sharding recipe of torch's ``IterableDataset`` documentation."""
    info = get_worker_info()
    dataset = info.dataset
    overall_start, overall_end = dataset.start, dataset.end
    per_worker = int(math.ceil((overall_end - overall_start) / float(info.num_workers)))
    dataset.start = overall_start + info.id * per_worker
    dataset.end = min(dataset.start + per_worker, overall_end)


def make_loader(num_workers: int, source: str = "map") -> DataLoader:
    if source == "batch-sampler":
        return DataLoader(list(range(SAMPLES)), batch_sampler=VaryingBatches(SAMPLES))
    if source == "stream":
        return DataLoader(CountingStream(SAMPLES), batch_size=BATCH_SIZE, num_workers=min(num_workers, 1))
    if source == "recipe":
        return DataLoader(RangeStream(0, SAMPLES), batch_size=BATCH_SIZE, num_workers=2, worker_init_fn=split_range,
                          persistent_workers=True)
    return DataLoader(list(range(SAMPLES)), batch_size=BATCH_SIZE, shuffle=True, num_workers=num_workers,
                      generator=torch.Generator().manual_seed(SEED))


def run(out: str, launch: int, workers: int, stop_epoch: int, stop_batch: int, source: str) -> None:
    accelerator = Accelerator(
        cpu=True,
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True,
                                                  dispatch_batches=False if source == "stream" else None),
        project_config=ProjectConfiguration(project_dir=str(Path(out) / source), automatic_checkpoint_naming=True,
                                            total_limit=2),
    )
    dl = accelerator.prepare(make_loader(workers, source))
    accelerator.resume()
    log = Path(out) / f"launch{launch}.{source}.rank{accelerator.process_index}.jsonl"
    with open(log, "w") as f:
        for epoch in range(dl.epoch, EPOCHS):
            taken = 0
            for batch in dl:
                taken += 1
                f.write(json.dumps({"launch": launch, "epoch": epoch, "ids": batch.tolist()}) + "\n")
                if (epoch, taken) == (stop_epoch, stop_batch):
                    f.flush()
                    accelerator.save_state()
                    return
    accelerator.wait_for_everyone()


def main() -> None:
    out, launch, workers, stop_epoch, stop_batch = sys.argv[1], *map(int, sys.argv[2:6])
    for source in SOURCES:
        run(out, launch, workers, stop_epoch, stop_batch, source)


if __name__ == "__main__":
    main()
