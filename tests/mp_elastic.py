"""One launch of the elastic chain: resume the newest checkpoint on this world size, run to a stop, save.

Each batch trains a DDP model with gradient accumulation over 2 steps, and the first stop falls inside an
accumulation window, so a rank that disagrees with the others on ``accelerator.step`` after an elastic
resume deadlocks the launch (the collective timeout ends it in a minute).

Run under ``accelerate launch`` by ``test_elastic_mp.py``:
``mp_elastic.py OUT_DIR LAUNCH NUM_WORKERS STOP_EPOCH STOP_BATCH`` (``STOP_EPOCH`` -1: run to the end).
Every source of ``SOURCES`` runs in turn, each with its own ``Accelerator`` and project folder
``OUT_DIR/<source>``; a run stops after its ``STOP_BATCH``-th batch of epoch ``STOP_EPOCH`` in this launch.
Each rank appends ``{"launch", "epoch", "ids"}`` per batch to ``OUT_DIR/launch<L>.<source>.rank<R>.jsonl``, and
writes ``OUT_DIR/launch<L>.<source>.rank<R>.meta.json`` right after resuming: ``accelerator.step``, one draw
of ``torch.rand`` and, on rank 0, its restored torch RNG state.
"""

from __future__ import annotations

import datetime
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, ProjectConfiguration
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, get_worker_info

from accelerate_stateful import Accelerator, SampleRNG, sample_rng
import mp_harness_rank
from streams import CountingStream

SAMPLES, BATCH_SIZE, EPOCHS, SEED, ACCUMULATION = 53, 3, 4, 5, 2
# map: map-style data, each rank its shard, each sample augmented through sample_rng; batch-sampler: a user's shuffled batch_sampler of varying batch
# sizes, without workers (test_multiprocess runs it with two); stream: a stateful stream every rank reads whole
# (dispatch_batches=False), read by one worker whenever the chain has workers (0 and 1 both read it whole;
# other worker counts are dealt its saved worker shares, tests/test_stream_workers_elastic.py); recipe: torch's worker_init_fn sharding recipe under the
# default dispatcher, an opaque stream fast-forwarded on resume, two persistent workers throughout. An opaque
# stream read whole is rescaled in-process only (test_replicated_elastic.py): it resumes as the recipe does.
# numpy-sampler: a user sampler that shuffles with NumPy's global RNG (its order is drawn under a scope seeded
# from (data_seed, epoch), so it is the same on every topology and after every resume).
SOURCES = ("map", "batch-sampler", "stream", "recipe", "numpy-sampler")
DATA_SEEDS = {"numpy-sampler": SEED}


def augmentation(rng: SampleRNG) -> int:
    """An integer drawn from the sample's torch, numpy and random generators (exact to compare)."""
    drawn = torch.randint(1 << 20, (), generator=rng.torch)
    return int(drawn) + int(rng.numpy.randint(1 << 20)) + rng.random.randrange(1 << 20)


class Augmented(Dataset):
    """Sample ``i`` is ``[i, augmentation(sample_rng(i))]``: its augmentation may not depend on the topology."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, augmentation(sample_rng(index))])


def ids_and_draws(batch: torch.Tensor) -> tuple[list, list]:
    """The sample ids of a batch, and the augmentation drawn for each (map source), else ``[]``."""
    return (batch[:, 0].tolist(), batch[:, 1].tolist()) if batch.dim() == 2 else (batch.tolist(), [])


class NumpyShuffle(Sampler):
    """Shuffles with ``np.random`` (the global RNG), as many user samplers do after ``set_seed``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(np.random.permutation(self.n).tolist())

    def __len__(self) -> int:
        return self.n


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
    if source == "numpy-sampler":
        return DataLoader(list(range(SAMPLES)), batch_size=BATCH_SIZE, sampler=NumpyShuffle(SAMPLES),
                          num_workers=num_workers)
    if source == "batch-sampler":
        return DataLoader(list(range(SAMPLES)), batch_sampler=VaryingBatches(SAMPLES))
    if source == "stream":
        return DataLoader(CountingStream(SAMPLES), batch_size=BATCH_SIZE, num_workers=min(num_workers, 1))
    if source == "recipe":
        return DataLoader(RangeStream(0, SAMPLES), batch_size=BATCH_SIZE, num_workers=2, worker_init_fn=split_range,
                          persistent_workers=True)
    return DataLoader(Augmented(), batch_size=BATCH_SIZE, shuffle=True, num_workers=num_workers,
                      generator=torch.Generator().manual_seed(SEED))


def run(out: str, launch: int, workers: int, stop_epoch: int, stop_batch: int, source: str) -> None:
    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_steps=ACCUMULATION,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=60))],
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True,
                                                  dispatch_batches=False if source == "stream" else None,
                                                  data_seed=DATA_SEEDS.get(source)),
        project_config=ProjectConfiguration(project_dir=str(Path(out) / source), automatic_checkpoint_naming=True,
                                            total_limit=2),
    )
    torch.manual_seed(100 + accelerator.process_index)  # what the RNGs hold before a checkpoint is loaded
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, dl = accelerator.prepare(model, optimizer, make_loader(workers, source))
    accelerator.resume()
    rank = accelerator.process_index
    meta = {"step": accelerator.step, "rng_state": torch.get_rng_state().tolist() if rank == 0 else None}
    meta["rand"] = torch.rand(1).item()
    (Path(out) / f"launch{launch}.{source}.rank{rank}.meta.json").write_text(json.dumps(meta))
    log = Path(out) / f"launch{launch}.{source}.rank{rank}.jsonl"
    with open(log, "w") as f:
        for epoch in range(dl.epoch, EPOCHS):
            taken = 0
            for batch in dl:
                taken += 1
                with accelerator.accumulate(model):
                    ids, draws = ids_and_draws(batch)
                    accelerator.backward(model(torch.tensor(ids).float().unsqueeze(1)).pow(2).mean())
                    optimizer.step()
                    optimizer.zero_grad()
                f.write(json.dumps({"launch": launch, "epoch": epoch, "ids": ids, "draws": draws}) + "\n")
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
    mp_harness_rank.run(main)
