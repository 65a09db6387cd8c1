"""Where DeepSpeed keeps the partial gradient of an accumulation window, and whether a checkpoint can carry it.

Under DeepSpeed, Accelerate's ``backward`` tells the engine whether a micro-step ends the window; the engine
reduces and steps at that boundary only. Between boundaries the partial sum is wherever the optimizer DeepSpeed
built around the user's keeps it, which the engine's configuration decides:

- **each parameter's ``.grad``**, as under DDP, where the engine's optimizer is the user's own (ZeRO-0 in fp32),
  DeepSpeed's unfused low-precision wrapper (ZeRO-0 with bf16 or fp16), or ZeRO-1's ``DeepSpeedZeroOptimizer``
  accumulating in the parameters' dtype, optimizer state on the device. A checkpoint carries it as DDP's
  (``_accumulation``): tested bitwise on 2 processes (``tests/test_deepspeed.py``).
- **DeepSpeed's own buffers** otherwise: ZeRO-2 reduces every micro-step into this rank's gradient partition,
  ZeRO-3 likewise, ZeRO-1 with another accumulation dtype (``data_types.grad_accum_dtype``: bf16 parameters with
  fp32 accumulation) into ``grad_accum`` or its BF16 optimizer's flat buffers, ``offload_optimizer`` into CPU
  copies. A save inside a window is refused there (carrying ``.grad`` would silently miss the window: tested).

Every rank builds its engine from the same configuration, so every rank decides the same.
"""

from __future__ import annotations

from typing import Any, Optional

# DeepSpeed's low-precision wrapper for ZeRO-0 that leaves the partial sum in each parameter's .grad.
_IN_GRAD_WRAPPERS = ("FP16_UnfusedOptimizer",)


def out_of_reach(accelerator: Any) -> Optional[str]:
    """``None`` where every DeepSpeed engine keeps the window's partial gradient in ``.grad``; else the setup
    that keeps it in DeepSpeed's own buffers, in the user's terms (for the refusal's message)."""
    engines = [model for model in accelerator._models if _is_engine(model)]
    if not engines:  # nothing prepared yet: no engine holds a gradient, but name a stage that would
        stage = accelerator.state.deepspeed_plugin.zero_stage
        return f"DeepSpeed ZeRO-{stage}" if stage >= 2 else None
    return next(filter(None, (_keeper(engine) for engine in engines)), None)


def _is_engine(model: Any) -> bool:
    try:
        from deepspeed.runtime.engine import DeepSpeedEngine
    except ImportError:
        return False
    return isinstance(model, DeepSpeedEngine)


def _keeper(engine: Any) -> Optional[str]:
    """``None`` when ``engine`` keeps the partial sum in ``.grad``, else what keeps it elsewhere."""
    optimizer = engine.optimizer
    stage = engine.zero_optimization_stage()
    name = f"DeepSpeed ZeRO-{stage}"
    if optimizer is None or optimizer is engine.basic_optimizer or type(optimizer).__name__ in _IN_GRAD_WRAPPERS:
        return None
    if stage >= 2:
        return name
    model_dtype, accumulation_dtype = engine.get_data_types()
    if model_dtype != accumulation_dtype:
        return (f"{name} accumulating {_dtype(model_dtype)} gradients in {_dtype(accumulation_dtype)} "
                "(data_types.grad_accum_dtype)")
    in_grad = ("cpu_offload", "use_grad_accum_attribute")  # both False: ZeRO-1 leaves the sum in .grad
    if type(optimizer).__name__ == "DeepSpeedZeroOptimizer" and all(getattr(optimizer, a, None) is False
                                                                      for a in in_grad):
        return None
    if getattr(optimizer, "cpu_offload", False):
        return f"{name} with offload_optimizer"
    return f"{name} with DeepSpeed's {type(optimizer).__name__}"


def _dtype(dtype: Any) -> str:
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(str(dtype).rpartition(".")[2], str(dtype))
