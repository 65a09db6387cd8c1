"""Preemption checkpoints: what deciding once per optimizer step costs when no signal arrives.

Two loops, each with the handler on and off, side by side in one process (order rotated every round, best of
the rounds): a tiny hand-written loop (``Linear(8, 1)``, batch 1, ``accelerator.checkpoint_on_preemption()``
on or not) and a tiny 🤗 ``StatefulTrainer`` (a 2-layer GPT-2 of 32 wide, ``preemption_signals`` default or
``()``). The figure is seconds per optimizer step, timed from the 10th step to the last. In one process the
decision is a flag test; with several, one all-reduce of one int per optimizer step, started at one step and
read at the next (so it overlaps a step)::

    python benchmarks/bench_preemption.py                       # 1 process
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 benchmarks/bench_preemption.py --launched
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import no_gc, rotated, run_main, table  # noqa: E402

QUICK = {"steps": 60, "rounds": 1}
FULL = {"steps": 200, "rounds": 3}
WARMUP = 10  # steps not timed: first-call costs (allocations, the first all-reduce)


def _per_step(times: list[float]) -> float:
    timed = times[WARMUP:]
    return (timed[-1] - timed[0]) / (len(timed) - 1)


def hand_loop(steps: int, preemption: bool, root: Path) -> float:
    """Seconds per optimizer step of a tiny hand-written loop, with or without the preemption checkpoint."""
    from accelerate.state import GradientState
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration

    from accelerate_stateful import Accelerator

    GradientState._reset_state()
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True, data_seed=0),
        project_config=ProjectConfiguration(project_dir=str(root / f"loop-{preemption}"),
                                            automatic_checkpoint_naming=True),
    )
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1000)
    loader = torch.utils.data.DataLoader(torch.randn(steps * accelerator.num_processes, 8), batch_size=1)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    if preemption:
        accelerator.checkpoint_on_preemption()
    times = []
    try:
        with no_gc():
            for batch in loader:
                accelerator.backward(model(batch).pow(2).mean())
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                times.append(time.perf_counter())
        return _per_step(times)
    finally:
        accelerator.free_memory()


def trainer_loop(steps: int, preemption: bool, root: Path) -> float:
    """Seconds per optimizer step of a tiny ``StatefulTrainer``, with or without its preemption handler."""
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

    from accelerate_stateful.integrations.transformers import StatefulTrainer

    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter())

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    rows = [{"input_ids": [2 + (i * k) % 60 for k in range(1, 9)]} for i in range(steps * 8)]
    rows = [dict(r, labels=r["input_ids"]) for r in rows]
    args = TrainingArguments(str(root / f"trainer-{preemption}"), per_device_train_batch_size=2, max_steps=steps,
                             save_strategy="no", logging_steps=10_000, report_to=[], disable_tqdm=True,
                             dataloader_num_workers=0, use_cpu=True)
    signals = {} if preemption else {"preemption_signals": ()}
    trainer = StatefulTrainer(model=model, args=args, train_dataset=rows, callbacks=[Clock()], **signals)
    with no_gc():
        trainer.train()
    trainer.accelerator.free_memory()
    return _per_step(times)


LOOPS: dict[str, Callable[[int, bool, Path], float]] = {"hand-written loop": hand_loop, "StatefulTrainer": trainer_loop}


def timings(steps: int, rounds: int) -> dict[str, dict[bool, float]]:
    """Best seconds per step of each loop, handler off (False) and on (True), interleaved round by round."""
    found: dict[str, dict[bool, float]] = {name: {} for name in LOOPS}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(rounds):
            for name, loop in LOOPS.items():
                for preemption in rotated((False, True), round_index):
                    seconds = loop(steps, preemption, Path(tmp) / f"{round_index}")
                    found[name][preemption] = min(seconds, found[name].get(preemption, float("inf")))
    return found


def rows(found: dict[str, dict[bool, float]]) -> list[list[str]]:
    return [[name, f"{t[False] * 1e6:.1f}", f"{t[True] * 1e6:.1f}", f"{t[True] / t[False]:.3f}"]
            for name, t in found.items()]


HEADER = ["loop", "off (us/step)", "on (us/step)", "on / off"]


def measure(sizes: dict, started: float):
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(1)  # a tiny model: more threads only contend
    found = timings(sizes["steps"], sizes["rounds"])

    def render(env: dict) -> str:
        lines = ["## Preemption checkpoint: cost per optimizer step, no signal (1 process)", ""]
        lines += [f"- {k}: {v}" for k, v in env.items()]
        lines += ["", f"{sizes['steps']} steps, best of {sizes['rounds']} rounds.", ""]
        return "\n".join(lines + table(HEADER, rows(found))) + "\n"

    return render, found


def launched(steps: int, rounds: int) -> None:
    """Under ``accelerate launch`` (several processes): the decision is one all-reduce per optimizer step."""
    import torch.distributed as dist

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    found = timings(steps, rounds)
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} processes, {steps} steps, best of {rounds}:", flush=True)
        print("\n".join(table(HEADER, rows(found))), flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--launched" in argv:
        launched(FULL["steps"], FULL["rounds"])
        return 0
    return run_main(argv, __doc__, "60 steps, 1 round", (QUICK, FULL), measure)


if __name__ == "__main__":
    sys.exit(main())
