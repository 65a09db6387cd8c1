"""Rank script of ``test_messages_seen``: a run with no logging set up that starts fresh, saves, and resumes.

Argument: the project folder. What the package prints goes to stderr through Python's default (the launch log).
"""

from __future__ import annotations

import sys

import torch
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
from torch.utils.data import DataLoader

import mp_harness_rank
from accelerate_stateful import Accelerator


def main(project: str) -> None:
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
                              project_config=ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True))
    set_seed(0)
    model = torch.nn.Linear(1, 1)
    model, optimizer, dl = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                               DataLoader(list(range(16)), batch_size=2))
    accelerator.resume()  # nothing yet: one line, from the main process
    for i, batch in enumerate(dl):
        accelerator.backward(model(batch.float().unsqueeze(1)).sum())
        optimizer.step()
        optimizer.zero_grad()
        if i == 1:
            accelerator.save_state()
            break
    accelerator.resume()  # checkpoint_0: one line, from the main process
    accelerator.end_training()


if __name__ == "__main__":
    mp_harness_rank.run(main, sys.argv[1])
