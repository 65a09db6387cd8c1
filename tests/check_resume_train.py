"""A tiny training script for ``tests/test_check_resume.py``, with resume bugs the checker must catch.

Run as ``python check_resume_train.py [--bug drop|perturb|workers]`` (or with ``accelerate launch`` on 2 or 3
processes: the global batch stays 6 samples), in the folder the checker gives it: it writes its
checkpoints under ``run/``, saves in the middle of each of its two epochs (steps 2 and 6), and resumes with
``accelerator.resume()``.

- no ``--bug``: a correct script; resumed runs continue exactly;
- ``--bug drop``: a resumed run's loader skips one batch (a loader that drops a batch at a resume);
- ``--bug perturb``: a resumed run nudges a weight (samples stay the same, the weights differ);
- ``--bug workers``: the dataset's items depend on the DataLoader worker reading them (right with 0 workers,
  wrong with ``check-resume --workers 0,2``).
"""

from __future__ import annotations

import argparse

import torch
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
from torch.utils.data import DataLoader, TensorDataset, get_worker_info

from accelerate_stateful import Accelerator


class WorkerDependent(TensorDataset):
    """A dataset whose sample ids shift when a DataLoader worker reads them: the same with 0 workers only."""

    def __getitem__(self, index: int) -> tuple:
        ids, x, y = super().__getitem__(index)
        info = get_worker_info()
        return (ids + 100 * (info.id + 1) if info is not None else ids), x, y


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bug", choices=["drop", "perturb", "workers"])
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    accelerator = Accelerator(
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
        project_config=ProjectConfiguration(project_dir="run", automatic_checkpoint_naming=True, total_limit=2),
    )
    set_seed(0)
    data = (WorkerDependent if args.bug == "workers" else TensorDataset)(torch.arange(24), torch.randn(24, 4), torch.randn(24, 1))
    per_rank = 6 // accelerator.num_processes  # a global batch of 6 on 1, 2 or 3 processes (check-resume --processes)
    loader = DataLoader(data, batch_size=per_rank, shuffle=True, generator=torch.Generator().manual_seed(0))
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    resumed = accelerator.resume() is not None
    if resumed and args.bug == "perturb":
        with torch.no_grad():
            model.weight[0, 0] += 1e-3
    if resumed and args.bug == "drop":
        loader.seek(loader.batches_yielded + 1)  # the resumed loader starts one batch too far
    for _ in range(loader.epoch, args.epochs):
        for _ids, x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if loader.batches_yielded == 2:  # steps 2 and 6: a kill after step 3 resumes from step 2, not a boundary
                accelerator.save_state()


if __name__ == "__main__":
    main()
