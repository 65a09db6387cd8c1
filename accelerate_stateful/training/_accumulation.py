"""The partial gradient of an accumulation window, carried across a save.

Between two micro-steps of ``accelerator.accumulate`` every rank holds its own
partial sum (gradient sync is off inside the window), and Accelerate's
checkpoint holds weights, optimizer, scheduler, RNG and the accumulation step
but not that sum: the step completing the window would differ after a resume.
The rule: **a checkpoint holds every gradient state that exists when it is
saved, per rank, where the framework keeps it** (a parameter's ``.grad``, also
under DeepSpeed ZeRO-0/1 as ``_deepspeed`` tells; under FSDP2 its own states,
``_fsdp2``), and loading puts exactly those back (and clears any other), so the
restored process is the saved one. Where a framework keeps it out of reach
(DeepSpeed ZeRO-2/3 and the ZeRO-1 setups ``_deepspeed`` names, FSDP1), a save
inside a window is refused. The carry is taken, or refused, at ``save_state``'s entry on every
rank (:func:`take`), before anything is written.

Layout: ``<checkpoint>/accelerate_stateful/gradients.rank_<r>.safetensors``,
keys ``model_<i>/<parameter name>`` (names of the unwrapped model, so they do
not depend on the DDP wrapper; FSDP2's states add ``@unsharded``,
``@accumulated`` or ``@shard``). Nothing is written when no parameter has a
gradient (a save at a window boundary, after ``zero_grad``). The manifest,
written last, lists these files with their hashes, so a checkpoint missing one
is incomplete. ``Accelerator(carry_gradients=False)`` writes none.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .._context import DistContext
from ..checkpoint import _checkpoints, _files
from ..errors import CheckpointError, UnsupportedConfigError
from . import _deepspeed, _fsdp2


def gradient_file(checkpoint: Path, rank: int) -> Path:
    return Path(checkpoint) / _files.SUBDIR / f"gradients.rank_{rank}.safetensors"


def _parameters(models: Iterable[torch.nn.Module]) -> dict[str, torch.nn.Parameter]:
    return {f"model_{i}/{name}": p for i, model in enumerate(models) for name, p in model.named_parameters()}


def _fsdp2_params(models: Iterable[torch.nn.Module]) -> dict[int, Any]:
    return {ident: owner for model in models for ident, owner in _fsdp2.params_of(model).items()}


@dataclass
class Carry:
    """This rank's gradients to write, taken at ``save_state``'s entry (CPU tensors), and every rank's size."""

    tensors: dict[str, torch.Tensor]
    sizes: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def take(ctx: DistContext, accelerator: Any) -> Optional[Carry]:
    """At ``save_state``'s entry: this rank's carry (``None`` with ``carry_gradients=False``), or the same
    refusal on every rank, before anything is written."""
    if not accelerator.carry_gradients:
        return None
    models = [accelerator.unwrap_model(model) for model in accelerator._models]
    carry = _checkpoints.agree(ctx, lambda: collect(models, *_unreachable(accelerator)))
    carry.sizes = ctx.all_gather(carry.nbytes)
    return carry


def _unreachable(accelerator: Any) -> tuple[Optional[str], bool]:
    """The framework keeping gradients out of this package's reach, if any, and whether a save now falls
    inside an accumulation window (``sync_gradients`` is False; for FSDP1, also any gradient held)."""
    from accelerate.utils import DistributedType

    inside = not accelerator.sync_gradients
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return _deepspeed.out_of_reach(accelerator), inside
    # A model wrapped in FSDP1 means its module is loaded; this package never imports it (seconds at start).
    fsdp1 = getattr(sys.modules.get("torch.distributed.fsdp"), "FullyShardedDataParallel", ())
    wrapped = [model for model in accelerator._models if isinstance(model, fsdp1)]
    if wrapped:
        held = any(p.grad is not None for model in wrapped for p in model.parameters())
        return "FSDP (version 1)", inside or held
    return None, inside


def collect(models: Iterable[torch.nn.Module], unreachable: Optional[str], inside_window: bool) -> Carry:
    """Every gradient this rank holds (plain ``.grad``, FSDP2's states), or a refusal naming the fix.

    Run at ``save_state``'s entry, under ``agree``, so a refusal comes on every rank before anything is
    written. ``unreachable`` names a framework keeping gradients where this package cannot read them
    (DeepSpeed ZeRO-2/3 and some ZeRO-1 setups, FSDP version 1): a save there is refused inside an
    accumulation window.
    """
    models = list(models)
    if unreachable is not None and inside_window:
        raise UnsupportedConfigError(
            f"accelerator.save_state() inside a gradient-accumulation window: {unreachable} keeps the partial "
            "gradient of the window in its own buffers, which a checkpoint cannot carry, so the resumed run "
            "would differ; save only when accelerator.sync_gradients is True (after the optimizer step that "
            "ends the window)"
        )
    owners = _fsdp2_params(models)
    tensors: dict[str, torch.Tensor] = {}
    for key, param in _parameters(models).items():
        if id(param) in owners:
            tensors.update(_fsdp2.collect(key, owners[id(param)]))
            continue
        grad = param.grad
        if grad is None:
            continue
        if type(grad) is not torch.Tensor or grad.is_sparse:
            raise UnsupportedConfigError(
                f"cannot carry the partial gradient of {key} across this save: it is a {type(grad).__name__} "
                "(sharded or sparse); save only when accelerator.sync_gradients is True, after "
                "optimizer.zero_grad(), or pass carry_gradients=False to Accelerator and accept that the "
                "resumed window misses it"
            )
        tensors[key] = grad.detach().cpu().contiguous()
    return Carry(tensors)


def write_gradients(checkpoint: Path, rank: int, carry: Carry) -> Optional[Path]:
    """Write this rank's carried gradients; returns the file, or ``None`` when there are none."""
    if not carry.tensors:
        return None
    path = gradient_file(checkpoint, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    _files.write_atomic(path, st_save(carry.tensors))
    return path


def size_line(sizes: list[int], checkpoint: Path) -> Optional[str]:
    """One line saying what the carry of every rank costs, or ``None`` when nothing was carried."""
    if not any(sizes):
        return None
    per_rank = ", ".join(_files.human_size(size) for size in sizes)
    return (f"saved the partial gradient of the accumulation window in {checkpoint}: "
            f"{_files.human_size(sum(sizes))} ({per_rank} per rank); a save when accelerator.sync_gradients is "
            "True carries none")


def _fsdp2_suffix(key: str) -> str:
    return next((s for s in (_fsdp2.SHARD, _fsdp2.UNSHARDED, _fsdp2.ACCUMULATED) if key.endswith(s)), "")


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
            _check_fits(gradient_file(checkpoint, r), key, grad, params, elastic=len(ranks) > 1)
            total[key] = grad if key not in total else total[key] + grad
    if len(ranks) > 1:
        total = {key: grad / len(ranks) for key, grad in total.items()}
    return total


def _check_fits(path: Path, key: str, grad: torch.Tensor, params: dict, elastic: bool) -> None:
    suffix = _fsdp2_suffix(key)
    if suffix and elastic:
        raise CheckpointError(
            f"{path} holds the partial gradient of an accumulation window as FSDP2 keeps it, per rank, which "
            "cannot be moved to another number of processes; resume on the number of processes that saved it, "
            "or from a checkpoint saved when accelerator.sync_gradients was True"
        )
    param = params.get(key[: len(key) - len(suffix)])
    shape = None if param is None else (_fsdp2.expected_shape(suffix, param) if suffix else tuple(param.shape))
    if shape != tuple(grad.shape):
        raise CheckpointError(
            f"{path} holds a gradient for {key} of shape {tuple(grad.shape)}, but this run's model has "
            f"{'no such parameter' if param is None else shape}; prepare the same models in the same order "
            "(and sharded the same way) as the run that saved it"
        )


def restore_gradients(grads: Optional[dict[str, torch.Tensor]], models: Iterable[torch.nn.Module]) -> None:
    """Put ``grads`` back where they were taken (same device and dtype as saved); clear every other."""
    grads = grads or {}
    models = list(models)
    owners = _fsdp2_params(models)
    for key, param in _parameters(models).items():
        if id(param) in owners:
            _fsdp2.restore(key, owners[id(param)], grads)
            continue
        grad = grads.get(key)
        param.grad = None if grad is None else grad.to(device=param.device)


def _load(path: Path) -> dict[str, Any]:
    try:
        return st_load(path.read_bytes())
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise CheckpointError(
            f"{path} is not a valid safetensors file ({exc}); resume from another checkpoint"
        ) from None
