"""Where FSDP2 (``torch.distributed.fsdp.fully_shard``) keeps the partial gradient of an accumulation window.

Under ``fully_shard`` a parameter of the model is a DTensor shard; FSDP2 keeps, per parameter, an ``FSDPParam``
holding up to three gradient states, all of them this rank's own:

- ``@shard``: the sharded gradient (``param.grad``, a DTensor; its local tensor is saved), present once a
  backward has synced, e.g. with manual accumulation (no ``accumulate``) or before a save at a boundary that
  did not zero the gradients. It is ``1/world`` of the parameter.
- ``@unsharded``: the whole, unreduced gradient of the window so far (``set_requires_gradient_sync(False)``,
  which ``accelerator.accumulate`` calls on every micro-step but the last). FSDP2 keeps it on the unsharded
  parameter; it is the size of the parameter on every rank, as DDP's ``.grad``.
- ``@accumulated``: the same in the reduce dtype, when a mixed-precision policy reduces in another dtype.

A checkpoint holds each of them that exists, per rank, and loading puts each back where FSDP2 reads it: the
unsharded parameter exists only after a forward, so a restored ``@unsharded`` gradient (there is then no
``@accumulated`` one: FSDP2 folds one into the other after every backward) goes into
``unsharded_accumulated_grad``, which FSDP2 adds the next backward's gradient to (``a + b`` is ``b + a``
bitwise) and reduces from. These are FSDP2's private attributes: a torch whose FSDP2 lacks them is refused
at save time (:func:`params_of`), never carried approximately.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..errors import CheckpointError, UnsupportedConfigError

SHARD, UNSHARDED, ACCUMULATED = "@shard", "@unsharded", "@accumulated"
_NEEDED = ("sharded_param", "unsharded_accumulated_grad", "to_sharded_dtensor", "sharded_size", "is_dtensor")


def params_of(model: torch.nn.Module) -> dict[int, Any]:
    """``id(parameter) -> FSDPParam`` for every parameter of ``model`` that FSDP2 manages (empty without FSDP2)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state
    except ImportError:
        return {}
    owners: dict[int, Any] = {}
    for module in model.modules():
        state = _get_module_fsdp_state(module)
        for group in getattr(state, "_fsdp_param_groups", None) or []:
            for fsdp_param in group.fsdp_params:
                missing = [name for name in _NEEDED if not hasattr(fsdp_param, name)]
                if missing:
                    raise UnsupportedConfigError(
                        f"this torch's FSDP2 keeps gradients where accelerate-stateful cannot read them (no "
                        f"{', '.join(missing)}): save only when accelerator.sync_gradients is True and after "
                        "optimizer.zero_grad(), or use the torch release this package supports"
                    )
                owners[id(fsdp_param.sharded_param)] = fsdp_param
    return owners


def collect(key: str, fsdp_param: Any) -> dict[str, torch.Tensor]:
    """This rank's gradient states of one FSDP2 parameter, as CPU tensors keyed ``key@shard`` and so on."""
    found: dict[str, torch.Tensor] = {}
    shard = fsdp_param.sharded_param.grad
    if shard is not None:
        found[key + SHARD] = shard.to_local().detach()
    unsharded = getattr(getattr(fsdp_param, "_unsharded_param", None), "grad", None)
    for suffix, grad in ((UNSHARDED, unsharded), (ACCUMULATED, fsdp_param.unsharded_accumulated_grad)):
        if grad is None:
            continue
        if fsdp_param.is_dtensor or type(grad) is not torch.Tensor:
            raise UnsupportedConfigError(
                f"cannot carry the partial gradient of {key} across this save: FSDP2 holds it as a "
                f"{type(grad).__name__} (a parameter sharded by tensor parallelism too); save only when "
                "accelerator.sync_gradients is True"
            )
        found[key + suffix] = grad.detach()
    return {name: tensor.cpu().contiguous() for name, tensor in found.items()}


def expected_shape(suffix: str, param: torch.nn.Parameter) -> tuple:
    """The shape a saved state of ``param`` must have: its local shard's, or the whole parameter's."""
    if suffix == SHARD:
        with torch.no_grad():
            return tuple(param.to_local().shape)
    return tuple(param.shape)


def restore(key: str, fsdp_param: Any, grads: dict[str, torch.Tensor]) -> None:
    """Put this rank's saved states of one FSDP2 parameter back (and clear any it did not save)."""
    shard = grads.get(key + SHARD)
    param = fsdp_param.sharded_param
    param.grad = None if shard is None else fsdp_param.to_sharded_dtensor(shard.to(param.to_local().device))
    device = getattr(fsdp_param, "device", param.device)
    unsharded, accumulated = (_on(grads.get(key + s), device) for s in (UNSHARDED, ACCUMULATED))
    holder = getattr(fsdp_param, "_unsharded_param", None)
    if holder is not None:
        holder.grad = unsharded
        fsdp_param.unsharded_accumulated_grad = accumulated
        return
    if unsharded is not None and accumulated is not None:
        raise CheckpointError(
            f"the checkpoint holds both an unsharded and an accumulated partial gradient of {key}, which FSDP2 "
            "never keeps together between two micro-steps; resume from another checkpoint"
        )
    fsdp_param.unsharded_accumulated_grad = accumulated if accumulated is not None else unsharded


def _on(tensor: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    return None if tensor is None else tensor.to(device=device)
