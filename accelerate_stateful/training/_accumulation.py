"""The partial gradient of an accumulation window, carried across a save.

Between two micro-steps of ``accelerator.accumulate`` every rank holds its own
partial sum in each parameter's ``.grad`` (gradient sync is off inside the
window), and Accelerate's checkpoint holds weights, optimizer, scheduler, RNG
and the accumulation step but not that sum: the step completing the window
would differ after a resume. The rule: **a checkpoint holds every ``.grad``
that exists when it is saved, per rank**, and loading it puts exactly those
back (and clears any other), so the restored process is the saved one.

Layout: ``<checkpoint>/accelerate_stateful/gradients.rank_<r>.safetensors``,
keys ``model_<i>/<parameter name>`` (names of the unwrapped model, so they do
not depend on the DDP wrapper). Nothing is written when no parameter has a
gradient (a save at a window boundary, after ``zero_grad``). The manifest,
written last, lists these files with their hashes, so a checkpoint missing one
is incomplete. ``Accelerator(carry_gradients=False)`` writes none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Optional

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..checkpoint import _files
from ..errors import CheckpointError, UnsupportedConfigError


def gradient_file(checkpoint: Path, rank: int) -> Path:
    return Path(checkpoint) / _files.SUBDIR / f"gradients.rank_{rank}.safetensors"


def _parameters(models: Iterable[torch.nn.Module]) -> dict[str, torch.nn.Parameter]:
    return {f"model_{i}/{name}": p for i, model in enumerate(models) for name, p in model.named_parameters()}


def write_gradients(checkpoint: Path, rank: int, models: Iterable[torch.nn.Module]) -> Optional[Path]:
    """Write this rank's existing ``.grad`` tensors; returns the file, or ``None`` when there are none."""
    grads = {}
    for key, param in _parameters(models).items():
        grad = param.grad
        if grad is None:
            continue
        if type(grad) is not torch.Tensor or grad.is_sparse:
            raise UnsupportedConfigError(
                f"cannot carry the partial gradient of {key} across this save: it is a {type(grad).__name__} "
                "(sharded or sparse); save at the end of an accumulation window (after optimizer.zero_grad()), "
                "or pass carry_gradients=False to Accelerator and accept that the resumed window misses it"
            )
        grads[key] = grad.detach().cpu().contiguous()
    if not grads:
        return None
    path = gradient_file(checkpoint, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    _files.write_atomic(path, st_save(grads))
    return path


def read_gradients(
    checkpoint: Path, manifest: dict, rank: int, world_size: int, models: Iterable[torch.nn.Module]
) -> Optional[dict[str, torch.Tensor]]:
    """This rank's gradients to restore, checked against ``models``; ``None`` when none were pending.

    On the same number of processes each rank takes its own file. On another number (elastic resume)
    every rank takes the mean of the saved ranks' partial sums: the window's gradient, averaged over
    ranks when it completes, then counts what was accumulated before the save exactly once.
    """
    saved_world = int(manifest["world_size"])
    listed = [r for r in range(saved_world)
              if gradient_file(checkpoint, r).relative_to(checkpoint).as_posix() in manifest["files"]]
    if not listed:
        return None
    if len(listed) != saved_world:
        raise CheckpointError(
            f"{checkpoint} holds partial gradients for ranks {listed} of {saved_world}: the ranks were not in "
            "the same place of their accumulation window when it was saved; resume from another checkpoint"
        )
    ranks = [rank] if saved_world == world_size else list(range(saved_world))
    params = _parameters(models)
    total: dict[str, torch.Tensor] = {}
    for r in ranks:
        for key, grad in sorted(_load(gradient_file(checkpoint, r)).items()):
            param = params.get(key)
            if param is None or param.shape != grad.shape:
                raise CheckpointError(
                    f"{gradient_file(checkpoint, r)} holds a gradient for {key} of shape {tuple(grad.shape)}, but "
                    f"this run's model has {'no such parameter' if param is None else tuple(param.shape)}; "
                    "prepare the same models in the same order as the run that saved it"
                )
            total[key] = grad if key not in total else total[key] + grad
    if len(ranks) > 1:
        total = {key: grad / len(ranks) for key, grad in total.items()}
    return total


def restore_gradients(grads: Optional[dict[str, torch.Tensor]], models: Iterable[torch.nn.Module]) -> None:
    """Put ``grads`` into the parameters' ``.grad`` (same device and dtype as saved); clear every other."""
    grads = grads or {}
    for key, param in _parameters(models).items():
        grad = grads.get(key)
        param.grad = None if grad is None else grad.to(device=param.device)


def _load(path: Path) -> dict[str, Any]:
    try:
        return st_load(path.read_bytes())
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise CheckpointError(
            f"{path} is not a valid safetensors file ({exc}); resume from another checkpoint"
        ) from None
