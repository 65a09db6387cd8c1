"""DeepSpeed ZeRO training through Accelerate, saved inside and at the end of an accumulation window, resumed in
a fresh process: bitwise, or refused before anything is written.

Usage (2 processes on gloo; ``test_deepspeed.py`` runs it twice)::

    torchrun --standalone --nproc_per_node 2 tests/deepspeed_train.py --out DIR --phase full
    torchrun --standalone --nproc_per_node 2 tests/deepspeed_train.py --out DIR --phase resume

Accelerate runs DeepSpeed only on accelerators, so the script makes its DeepSpeed plugin run on CPU by setting
the distributed type after construction (``deepspeed_accelerator``): ``prepare`` then builds a real
``DeepSpeedEngine`` over the gloo process group, and ``accelerator.backward`` tells the engine where the
window ends, as on GPUs. DeepSpeed's CPU accelerator compiles a shared-memory all-reduce kernel (C++, about
40 s) when its communication starts; that kernel serves inference only (``inference_all_reduce``), so the
script marks it unavailable and training communicates over gloo, as it does without the kernel.

Each scenario of ``SCENARIOS`` (a ZeRO stage, DeepSpeed configuration added to the plugin's) trains ``STEPS``
micro-steps of a tiny MLP with dropout, AdamW, clipping (DeepSpeed's ``gradient_clipping``), gradient
accumulation 2 and augmentation drawn in ``__getitem__``, one scenario after another in the same processes.
``full`` saves after each micro-step of its saves into ``<out>/<name>_<step>`` and tries, after each of its
refused ones, a save that must be refused on every rank and leave nothing behind. ``resume`` loads each
checkpoint and trains to the end; it runs in a fresh launch, so nothing of the saving run is left but the
checkpoint. Each writes ``<out>/<phase>_rank<r>.pt``: per run, every micro-step's loss (``float.hex``), the
final parameters and optimizer state (ZeRO-3: this rank's partition of the parameters; ZeRO-1/2/3: this
rank's partition of the optimizer state), the names of the gradients each save carried, and per refused save
the error and the files it left.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import deepspeed
import torch
from accelerate.state import AcceleratorState, GradientState, PartialState
from accelerate.utils import DataLoaderConfiguration, DeepSpeedPlugin, DistributedType
from torch.utils.data import DataLoader

from accelerate_stateful import Accelerator, UnsupportedConfigError
from accelerate_stateful.training import _accumulation
from sharded_train import Augmented  # the FSDP2 check's data: augmentation drawn in __getitem__

STEPS, ACCUMULATION = 8, 2
BF16 = {"bf16": {"enabled": True}}  # bf16 parameters, gradients accumulated in bf16
BF16_FP32 = {**BF16, "data_types": {"grad_accum_dtype": "fp32"}}  # bf16 parameters, fp32 accumulation
# name: (ZeRO stage, DeepSpeed config added, saves resumed from, saves that must be refused); micro-step 3 is
# inside a window, 4 ends one.
SCENARIOS = {
    "zero0": (0, {}, (3,), ()),
    "zero0_bf16": (0, BF16, (3,), ()),
    "zero1": (1, {}, (3,), ()),
    "zero1_bf16_fp32": (1, BF16_FP32, (), (3,)),
    "zero2": (2, {}, (4,), (3,)),
    "zero3": (3, {}, (4,), (3,)),
}


def deepspeed_accelerator(stage: int, config: dict) -> Accelerator:
    """The package's Accelerator running Accelerate's DeepSpeed plugin at ZeRO ``stage`` on CPU."""
    AcceleratorState._reset_state()  # one scenario after another in this process, each with its own plugin
    GradientState._reset_state()
    if PartialState._shared_state:  # as Accelerate made it, so that the new state is built as the first was
        PartialState().distributed_type = DistributedType.MULTI_CPU
    plugin = DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=ACCUMULATION, gradient_clipping=0.5)
    accelerator = Accelerator(cpu=True, deepspeed_plugin=plugin,
                              dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    for state in (accelerator.state, PartialState()):  # Accelerate picks MULTI_CPU on CPU: make it DeepSpeed
        state.distributed_type = DistributedType.DEEPSPEED
    accelerator.state.deepspeed_plugins = plugin
    plugin.set_mixed_precision("no")
    plugin.deepspeed_config.update(config)
    plugin.select(_from_accelerator_state=True)
    return accelerator


def prepared(stage: int, config: dict) -> tuple:
    accelerator = deepspeed_accelerator(stage, config)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(7, 5), torch.nn.ReLU(), torch.nn.Linear(5, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    loader = DataLoader(Augmented(), batch_size=2, shuffle=True)
    return accelerator, *accelerator.prepare(model, optimizer, loader)


def micro_step(accelerator, model, optimizer, batch) -> str:
    with accelerator.accumulate(model):
        loss = model(batch["x"].to(next(model.parameters()).dtype)).float().square().mean()
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
    return float(loss.detach()).hex()


def train(accelerator, model, optimizer, loader, first: int, out: Path, name: str, saves=(), refused=()) -> dict:
    """Micro-steps ``first + 1`` to ``STEPS``: their losses, the final state, the gradients each save carried
    and what each refused save did."""
    log, carried, refusals = {}, {}, {}
    for step, batch in enumerate(loader, start=first + 1):
        log[step] = micro_step(accelerator, model, optimizer, batch)
        if step in saves:
            accelerator.save_state(out / f"{name}_{step}")
            carried[step] = _carried(out / f"{name}_{step}", accelerator.process_index)
        if step in refused:
            refusals[step] = refuse(accelerator, out / f"{name}_{step}")
        if step == STEPS:
            break
    params = [_local(p) for p in model.module.parameters()]
    return {"losses": log, "final": {"params": params, "optimizer": _tensors(optimizer.optimizer.state_dict())},
            "carried": carried, "refusals": refusals}


def refuse(accelerator, folder: Path) -> dict:
    """Try a save that must be refused: the error's text (``None`` if it saved), and the files left behind."""
    before = sorted(p.relative_to(folder.parent).as_posix() for p in folder.parent.rglob("*"))
    try:
        accelerator.save_state(folder)
        error = None
    except UnsupportedConfigError as exc:
        error = str(exc)
    after = sorted(p.relative_to(folder.parent).as_posix() for p in folder.parent.rglob("*"))
    accelerator.wait_for_everyone()  # every rank has looked before the next scenario writes
    return {"error": error, "new_files": sorted(set(after) - set(before))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--phase", choices=("full", "resume"), required=True)
    args = parser.parse_args()
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # inference-only kernel: see the docstring
    args.out.mkdir(parents=True, exist_ok=True)
    runs = {}
    for name, (stage, config, saves, refused) in SCENARIOS.items():
        if args.phase == "full":
            accelerator, model, optimizer, loader = prepared(stage, config)
            runs[name] = train(accelerator, model, optimizer, loader, 0, args.out, name, saves, refused)
            accelerator.free_memory()
            continue
        for saved in saves:  # a fresh process: nothing of the run that saved is left but its checkpoint
            accelerator, model, optimizer, loader = prepared(stage, config)
            accelerator.load_state(args.out / f"{name}_{saved}")
            runs[f"{name}_{saved}"] = train(accelerator, model, optimizer, loader, saved, args.out, name)
            accelerator.free_memory()
    torch.save(runs, args.out / f"{args.phase}_rank{accelerator.process_index}.pt")
    accelerator.end_training()


def _carried(checkpoint: Path, rank: int) -> list:
    """The names of the gradients this rank's part of ``checkpoint`` carries."""
    from safetensors.torch import load_file

    path = _accumulation.gradient_file(checkpoint, rank)
    return sorted(load_file(path)) if path.exists() else []


def _local(param: torch.nn.Parameter) -> torch.Tensor:
    """This rank's values of ``param``: its ZeRO-3 partition (``ds_tensor``), else the whole parameter."""
    return getattr(param, "ds_tensor", param).detach().clone()


def _tensors(state, path: str = "") -> dict:
    """Every tensor and number in a (nested) optimizer state dict, by path: ZeRO's partitions, AdamW's moments."""
    if isinstance(state, torch.Tensor):
        return {path: state.detach().clone()}
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in _tensors(value, f"{path}/{key}").items()}
    if isinstance(state, (list, tuple)):
        return {k: v for i, value in enumerate(state) for k, v in _tensors(value, f"{path}/{i}").items()}
    return {path: state} if isinstance(state, (int, float, bool, str)) or state is None else {}


if __name__ == "__main__":
    import mp_harness_rank

    mp_harness_rank.run(main)
