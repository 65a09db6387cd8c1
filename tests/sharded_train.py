"""FSDP2 training saved inside an accumulation window, resumed in a fresh process: bitwise or refused.

Usage (2 processes on gloo; ``test_sharded.py`` runs it twice)::

    torchrun --standalone --nproc_per_node 2 tests/sharded_train.py --out DIR --phase full
    torchrun --standalone --nproc_per_node 2 tests/sharded_train.py --out DIR --phase resume

Accelerate refuses FSDP on CPU, so the script makes its FSDP2 plugin run there by setting the distributed
type after construction (``fsdp2_accelerator``): ``prepare`` then shards with ``fully_shard`` and
``accelerator.accumulate`` turns gradient sync off inside a window, as on GPUs (FSDP2 then keeps the
unreduced gradient on the unsharded parameter). Micro-steps from ``MANUAL_FROM`` on accumulate manually (a
synced backward every micro-step: FSDP2 keeps the reduced shard in ``param.grad``). Layers of 7 and 5 rows
shard unevenly over 2 ranks; dropout, AdamW, clipping and augmentation drawn in ``__getitem__``.

``full`` trains ``STEPS`` micro-steps and saves after each micro-step of ``SAVES`` (one inside each kind of
window) into ``<out>/ckpt_<step>``. ``resume`` loads the first in a fresh process, in which FSDP2 has not run
a forward yet, trains to the end, then loads the second in the same process and trains to the end again.
Each writes ``<out>/<phase>_rank<r>.pt``: per run, every micro-step's loss (``float.hex``), the final local
parameter shards and optimizer state, and the names of the gradients each checkpoint carried.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from accelerate.state import PartialState
from accelerate.utils import DataLoaderConfiguration, DistributedType, FullyShardedDataParallelPlugin
from torch.utils.data import DataLoader, Dataset

from accelerate_stateful import Accelerator
from accelerate_stateful.training import _accumulation

STEPS, ACCUMULATION = 8, 2
SAVES = (3, 7)  # inside a window of accelerator.accumulate, inside a manual window
MANUAL_FROM = 5  # micro-steps from here accumulate manually


class Augmented(Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(3)
        self.x = torch.randn(40, 6, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict:
        return {"id": index, "x": self.x[index] + 0.1 * torch.randn(6)}


def fsdp2_accelerator(**kwargs) -> Accelerator:
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin, **kwargs)
    for state in (accelerator.state, PartialState()):  # Accelerate picks MULTI_CPU on CPU: make it FSDP
        state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    return accelerator


def model_and_optimizer(seed: int) -> tuple:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(7, 5), torch.nn.ReLU(), torch.nn.Linear(5, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=0.02)


def micro_step(accelerator, model, optimizer, batch, step: int) -> str:
    if step >= MANUAL_FROM:  # a synced backward every micro-step, an optimizer step every other one
        loss = backward(accelerator, model, batch)
        if step % ACCUMULATION == 0:
            optimizer.optimizer.step()
            optimizer.optimizer.zero_grad()
        return loss
    with accelerator.accumulate(model):
        loss = backward(accelerator, model, batch)
        accelerator.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
    return loss


def backward(accelerator, model, batch) -> str:
    loss = model(batch["x"]).square().mean()
    accelerator.backward(loss)
    return float(loss.detach()).hex()


def train(accelerator, model, optimizer, loader, first: int, out: Path, save: bool) -> dict:
    """Micro-steps ``first + 1`` to ``STEPS``: their losses, and the carry of each save made."""
    log, carried = {}, {}
    for step, batch in enumerate(loader, start=first + 1):
        log[step] = micro_step(accelerator, model, optimizer, batch, step)
        if save and step in SAVES:
            accelerator.save_state(out / f"ckpt_{step}")
            carried[step] = sorted(_load_carry(out / f"ckpt_{step}", accelerator.process_index))
        if step == STEPS:
            break
    final = {"params": [p.to_local().clone() for p in model.parameters()],
             "optimizer": [_local(v) for state in optimizer.state_dict()["state"].values() for v in state.values()]}
    return {"losses": log, "final": final, "carried": carried}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--phase", choices=("full", "resume"), required=True)
    args = parser.parse_args()
    accelerator = fsdp2_accelerator(gradient_accumulation_steps=ACCUMULATION,
                                    dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    model, optimizer = model_and_optimizer(0)
    loader = DataLoader(Augmented(), batch_size=2, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    runs = {}
    if args.phase == "full":
        runs["full"] = train(accelerator, model, optimizer, loader, 0, args.out, save=True)
    else:  # a fresh process (FSDP2 has not run a forward yet), then the same process again
        for saved in SAVES:
            accelerator.load_state(args.out / f"ckpt_{saved}")
            runs[saved] = train(accelerator, model, optimizer, loader, saved, args.out, save=False)
    torch.save(runs, args.out / f"{args.phase}_rank{accelerator.process_index}.pt")
    accelerator.end_training()


def _local(value):
    return value.to_local().clone() if hasattr(value, "to_local") else value.clone()


def _load_carry(checkpoint: Path, rank: int) -> list:
    from safetensors.torch import load_file

    path = _accumulation.gradient_file(checkpoint, rank)
    return list(load_file(path)) if path.exists() else []


if __name__ == "__main__":
    import mp_harness_rank

    mp_harness_rank.run(main)
