"""DeepSpeed ZeRO through Accelerate's plugin, the real engine on 2 processes over gloo (``deepspeed_train.py``):
where the engine keeps the partial gradient of a window in ``.grad`` (ZeRO-0, ZeRO-1 accumulating in the
parameters' dtype) a save inside the window resumes bitwise in a fresh process; where it keeps it in its own
buffers (ZeRO-2, ZeRO-3, ZeRO-1 with bf16 parameters and fp32 accumulation) such a save is refused on every
rank before anything is written, and a save at the window's end resumes bitwise."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import mp_harness
from accelerate_stateful.training import _deepspeed
from test_bitwise import differences

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "deepspeed_train.py"
CARRIED = {"zero0": 3, "zero0_bf16": 3, "zero1": 3}  # saved inside a window, the gradients carried
AT_BOUNDARY = {"zero2": 4, "zero3": 4}  # saved at a window's end: nothing to carry
REFUSED = {"zero1_bf16_fp32": "DeepSpeed ZeRO-1 accumulating bf16 gradients in fp32 (data_types.grad_accum_dtype)",
           "zero2": "DeepSpeed ZeRO-2", "zero3": "DeepSpeed ZeRO-3"}
PARAMETERS = 6  # the MLP's weights and biases


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_deepspeed_zero_resumes_bitwise_or_refuses_a_save_inside_a_window_before_writing(tmp_path):
    out = tmp_path / "out"  # the checkpoints alone: a refused save must leave nothing new here
    for phase in ("full", "resume"):  # the resume is a fresh launch: nothing of the saving run is left
        done = mp_harness.launch(mp_harness.torchrun_command(SCRIPT, ["--out", out, "--phase", phase]),
                                 tmp_path / f"{phase}.launch", timeout_s=180, DS_ACCELERATOR="cpu")
        assert done.ok, done.report()
    for rank in range(2):
        full = torch.load(out / f"full_rank{rank}.pt", weights_only=False)
        resumed = torch.load(out / f"resume_rank{rank}.pt", weights_only=False)
        for name, saved in CARRIED.items():
            assert len(full[name]["carried"][saved]) == PARAMETERS, (rank, name, full[name]["carried"])
        for name, saved in AT_BOUNDARY.items():
            assert full[name]["carried"][saved] == [], (rank, name, full[name]["carried"])
        for name, framework in REFUSED.items():
            [refusal] = full[name]["refusals"].values()
            assert re.search(rf"inside a gradient-accumulation window: {re.escape(framework)} keeps the partial "
                             r"gradient.*save only when accelerator\.sync_gradients is True", refusal["error"] or ""), \
                (rank, name, refusal["error"])
            assert "rank 1 failed too (UnsupportedConfigError)" in refusal["error"], refusal["error"]  # on every rank
            assert refusal["new_files"] == [], (rank, name, refusal["new_files"])
        assert sorted(resumed) == sorted(f"{name}_{saved}" for name, saved in {**CARRIED, **AT_BOUNDARY}.items())
        for key, run in resumed.items():
            name, _, saved = key.rpartition("_")
            reference = full[name]
            assert sorted(run["losses"]) == list(range(int(saved) + 1, 9))
            wrong = [step for step, loss in run["losses"].items() if loss != reference["losses"][step]]
            assert not wrong, f"rank {rank}, {key}: the losses of micro-steps {wrong} differ"
            assert not differences(reference["final"], run["final"]), (rank, key, differences(reference["final"],
                                                                                             run["final"]))


def engine(stage: int, optimizer: object, dtypes=(torch.float32, torch.float32), basic: object = None):
    """What ``_deepspeed`` reads of a ``DeepSpeedEngine``."""
    return SimpleNamespace(optimizer=optimizer, basic_optimizer=basic, zero_optimization_stage=lambda: stage,
                           get_data_types=lambda: dtypes)


def zero_optimizer(**attributes):
    return type("DeepSpeedZeroOptimizer", (), {"cpu_offload": False, "use_grad_accum_attribute": False,
                                               **attributes})()


def test_only_an_engine_keeping_the_partial_gradient_in_grad_is_carried_every_other_is_named():
    plain = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    bf16 = (torch.bfloat16, torch.bfloat16)
    assert _deepspeed._keeper(engine(0, plain, basic=plain)) is None
    assert _deepspeed._keeper(engine(0, type("FP16_UnfusedOptimizer", (), {})(), bf16)) is None
    assert _deepspeed._keeper(engine(1, zero_optimizer())) is None
    assert _deepspeed._keeper(engine(1, zero_optimizer(), bf16)) is None
    named = {
        "DeepSpeed ZeRO-2": engine(2, zero_optimizer()),
        "DeepSpeed ZeRO-3": engine(3, type("DeepSpeedZeroOptimizer_Stage3", (), {})()),
        "DeepSpeed ZeRO-1 with offload_optimizer": engine(1, zero_optimizer(cpu_offload=True)),
        "DeepSpeed ZeRO-1 accumulating bf16 gradients in fp32 (data_types.grad_accum_dtype)":
            engine(1, type("BF16_Optimizer", (), {})(), (torch.bfloat16, torch.float32)),
        "DeepSpeed ZeRO-1 with DeepSpeed's DeepSpeedZeroOptimizer":
            engine(1, zero_optimizer(use_grad_accum_attribute=True)),
        "DeepSpeed ZeRO-0 with DeepSpeed's FP16_Optimizer": engine(0, type("FP16_Optimizer", (), {})()),
    }
    assert {name: _deepspeed._keeper(one) for name, one in named.items()} == {name: name for name in named}
