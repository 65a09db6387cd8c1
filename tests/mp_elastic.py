"""One launch of the elastic chain: resume the newest checkpoint on this world size, run to a stop, save.

Run under ``accelerate launch`` by ``test_elastic_mp.py``:
``mp_elastic.py OUT_DIR LAUNCH NUM_WORKERS STOP_EPOCH STOP_BATCH`` (``STOP_EPOCH`` -1: run to the end).
Each rank appends ``{"launch", "epoch", "ids"}`` per batch to ``OUT_DIR/launch<L>.rank<R>.jsonl``; each
sample is ``[id, augmentation drawn from sample_rng(id)]``, which must not depend on the topology.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
from torch.utils.data import DataLoader, Dataset

from accelerate_stateful import Accelerator, SampleRNG, sample_rng

SAMPLES, BATCH_SIZE, EPOCHS, SEED = 53, 3, 4, 5


def augmentation(rng: SampleRNG) -> int:
    """An integer drawn from the sample's torch, numpy and random generators (exact to compare)."""
    drawn = torch.randint(1 << 20, (), generator=rng.torch)
    return int(drawn) + int(rng.numpy.randint(1 << 20)) + rng.random.randrange(1 << 20)


class Augmented(Dataset):
    """Sample ``i`` is ``[i, augmentation(sample_rng(i))]``."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, augmentation(sample_rng(index))])


def make_loader(num_workers: int) -> DataLoader:
    return DataLoader(Augmented(), batch_size=BATCH_SIZE, shuffle=True, num_workers=num_workers,
                      generator=torch.Generator().manual_seed(SEED))


def main() -> None:
    out, launch, workers, stop_epoch, stop_batch = sys.argv[1], *map(int, sys.argv[2:6])
    accelerator = Accelerator(
        cpu=True,
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
        project_config=ProjectConfiguration(project_dir=out, automatic_checkpoint_naming=True, total_limit=2),
    )
    dl = accelerator.prepare(make_loader(workers))
    accelerator.resume()
    log = Path(out) / f"launch{launch}.rank{accelerator.process_index}.jsonl"
    with open(log, "w") as f:
        for epoch in range(dl.epoch, EPOCHS):
            for batch in dl:
                f.write(json.dumps({"launch": launch, "epoch": epoch, "ids": batch.tolist()}) + "\n")
                if (epoch, dl.batches_yielded) == (stop_epoch, stop_batch):
                    f.flush()
                    accelerator.save_state()
                    return
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
