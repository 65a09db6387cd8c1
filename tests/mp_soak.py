"""One short job for the soak (``soak.py``): every kind of loader with workers, a checkpoint, then the exit.

    accelerate launch --multi_gpu --num_processes 2 tests/mp_soak.py OUT

Each rank reads a map-style loader, a stream every rank reads (its workers answer state requests from a
thread, with tensors in the state), and a dispatched stream, each with 2 workers; saves a checkpoint in
the middle of the epoch, abandons one loader mid-epoch (its workers still running), finishes the others,
calls ``accelerator.end_training()``, writes ``OUT/done_rank<r>`` and returns. What is left to test is
that the process then exits.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mp_harness_rank  # noqa: E402
from streams import CountingStream, HeavyStateStream  # noqa: E402

from accelerate_stateful import Accelerator  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1])
    accelerator = Accelerator(
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True, dispatch_batches=False),
        project_config=ProjectConfiguration(project_dir=str(out / "project"), automatic_checkpoint_naming=True,
                                            total_limit=1),
    )
    model = torch.nn.Linear(1, 1)
    mapped = DataLoader(list(range(48)), batch_size=2, shuffle=True, num_workers=2,
                        generator=torch.Generator().manual_seed(0))
    stream = DataLoader(HeavyStateStream(48, live=True, payload=50_000), batch_size=2, num_workers=2)
    model, mapped, stream = accelerator.prepare(model, mapped, stream)
    dispatched = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True,
                                                                        dispatch_batches=True))
    dispatch = dispatched.prepare(DataLoader(CountingStream(48), batch_size=2, num_workers=2))

    loaders = [iter(mapped), iter(stream), iter(dispatch)]
    for _ in range(3):
        for it in loaders:
            next(it)
    accelerator.save_state()  # workers of every loader are asked for their state
    next(loaders[1])  # the stream is abandoned mid-epoch: its workers are still running at the exit
    for it in (loaders[0], loaders[2]):
        for _ in it:
            pass
    accelerator.end_training()
    (out / f"done_rank{accelerator.process_index}").write_text("done")


if __name__ == "__main__":
    mp_harness_rank.run(main)
