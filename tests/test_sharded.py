"""The partial gradient of a window under FSDP2 is carried per rank and resumes bitwise; where a framework keeps
it out of reach (DeepSpeed ZeRO-2/3, FSDP1) a save inside a window is refused at the entry, before anything is
written; Megatron-LM, whose path bypasses the package, is refused at ``prepare``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from accelerate.state import PartialState
from accelerate.utils import DataLoaderConfiguration, DistributedType
from torch.utils.data import DataLoader

import mp_harness
from accelerate_stateful import Accelerator, UnsupportedConfigError
from accelerate_stateful.training._accumulation import collect
from test_bitwise import differences

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "sharded_train.py"
SAVES = (3, 7)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_fsdp2_saved_inside_either_kind_of_window_resumes_bitwise_in_a_fresh_process(tmp_path):
    for phase in ("full", "resume"):
        done = mp_harness.launch(mp_harness.torchrun_command(SCRIPT, ["--out", tmp_path, "--phase", phase]),
                                 tmp_path / f"{phase}.launch", timeout_s=180)
        assert done.ok, done.report()
    for rank in range(2):
        full = torch.load(tmp_path / f"full_rank{rank}.pt", weights_only=False)["full"]
        resumed = torch.load(tmp_path / f"resume_rank{rank}.pt", weights_only=False)
        # What FSDP2 held: the unreduced gradient inside accumulate(), the reduced shard with manual accumulation.
        assert {key.rpartition("@")[2] for key in full["carried"][3]} == {"unsharded"}, full["carried"]
        assert {key.rpartition("@")[2] for key in full["carried"][7]} == {"shard"}, full["carried"]
        for saved in SAVES:
            run = resumed[saved]
            assert sorted(run["losses"]) == list(range(saved + 1, 9))
            wrong = [step for step, loss in run["losses"].items() if loss != full["losses"][step]]
            assert not wrong, f"rank {rank}, resumed from {saved}: the losses of micro-steps {wrong} differ"
            assert not differences(full["final"], run["final"]), (rank, saved, differences(full["final"], run["final"]))


@pytest.mark.parametrize("framework", ["DeepSpeed ZeRO-2", "DeepSpeed ZeRO-3", "FSDP (version 1)"])
def test_a_framework_keeping_the_gradient_out_of_reach_is_refused_inside_a_window_only(framework):
    model = torch.nn.Linear(2, 1)
    expected = rf"inside a gradient-accumulation window: {re.escape(framework)} keeps the partial gradient.*" \
               r"sync_gradients is True"
    with pytest.raises(UnsupportedConfigError, match=expected):
        collect([model], framework, inside_window=True)
    assert collect([model], framework, inside_window=False).tensors == {}


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_megatron_lm_is_refused_at_prepare_with_the_alternatives():
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    for state in (accelerator.state, PartialState()):  # Megatron-LM needs GPUs and megatron-core: take its type
        state.distributed_type = DistributedType.MEGATRON_LM
    try:
        with pytest.raises(UnsupportedConfigError, match=r"cannot resume data under Megatron-LM.*"
                                                         r"use_stateful_dataloader=False"):
            accelerator.prepare(DataLoader(range(8), batch_size=2))
    finally:
        for state in (accelerator.state, PartialState()):
            state.distributed_type = DistributedType.NO
