"""One rank of a 2-process job whose rank 0 is killed (SIGKILL) at a chosen point, for ``tests/test_endings.py``.

Run as ``python endings.py OUT LOOP WORKERS KILL_STEP KILL_AT`` with the variables a launcher sets (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), without a launcher: the job is what is left after the
launcher and rank 0 were killed. ``LOOP`` is ``trainer`` (``StatefulTrainer``, a tiny GPT-2 built from a
config, nothing downloaded) or ``hand`` (this package's ``Accelerator``, ``checkpoint_on_preemption``). Both
install preemption handlers, so their data-loading workers ignore SIGTERM. Rank 0 kills itself after
optimizer step ``KILL_STEP``, at ``KILL_AT``:

- ``batch``: when the loop has its batch, before the forward pass;
- ``step``: right after the optimizer step;
- ``save``: inside the first checkpoint at or after that step, before its manifest (rank 1 waits in the save).

Rank 1 must then fail (a collective or the checkpoint's agreement breaks) and end, with all its workers.
Each rank writes ``OUT/rank<r>.log`` lines: ``pid``, then ``step <n>`` after each optimizer step.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
from torch.utils.data import Dataset

N, BATCH, STEPS, SAVE_EVERY = 96, 2, 14, 3


class Ids(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": [2 + i % 60, 2 + (i * 7) % 60, 2 + (i * 3) % 60, 2 + (i * 5) % 60]}


def collate(features: list[dict]) -> dict:
    ids = torch.tensor([f["input_ids"] for f in features])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


class Plan:
    def __init__(self, out: Path, step: int, at: str) -> None:
        self.rank = int(os.environ["RANK"])
        self.step, self.at = step, at
        self.log = open(out / f"rank{self.rank}.log", "a", buffering=1)
        self.log.write(f"pid {os.getpid()}\n")

    def reached(self, at: str, step: int) -> None:
        """Kill rank 0 here if this is the chosen point (``step``: optimizer steps done so far)."""
        if self.rank == 0 and at == self.at and step >= self.step:
            os.kill(os.getpid(), signal.SIGKILL)

    def stepped(self, step: int) -> None:
        self.log.write(f"step {step}\n")
        self.reached("step", step)

    def arm_save(self, steps_done) -> None:
        """Kill rank 0 inside a checkpoint's save, after its files, before its manifest."""
        from accelerate_stateful.checkpoint import _files

        original = _files.write_manifest

        def write_manifest(*args, **kwargs):
            self.reached("save", steps_done())
            return original(*args, **kwargs)

        _files.write_manifest = write_manifest


def train_with_trainer(out: Path, workers: int, plan: Plan) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

    from accelerate_stateful.integrations.transformers import StatefulTrainer

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=1, n_head=2))
    args = TrainingArguments(
        output_dir=str(out / "trainer"), per_device_train_batch_size=BATCH, dataloader_num_workers=workers,
        max_steps=STEPS, save_strategy="steps", save_steps=SAVE_EVERY, logging_steps=1, report_to=[],
        disable_tqdm=True, use_cpu=True, seed=0,
    )

    class Kill(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            plan.reached("batch", state.global_step)

        def on_step_end(self, args, state, control, **kwargs):
            plan.stepped(state.global_step)

    trainer = StatefulTrainer(model=model, args=args, train_dataset=Ids(), data_collator=collate, callbacks=[Kill()])
    plan.arm_save(lambda: trainer.state.global_step)
    trainer.train()


def train_by_hand(out: Path, workers: int, plan: Plan) -> None:
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
    from torch.utils.data import DataLoader

    from accelerate_stateful import Accelerator

    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
        project_config=ProjectConfiguration(project_dir=str(out / "hand"), automatic_checkpoint_naming=True),
    )
    torch.manual_seed(0)
    model = torch.nn.Embedding(64, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = DataLoader(Ids(), batch_size=BATCH, shuffle=True, num_workers=workers, collate_fn=collate)
    model, optimizer, dl = accelerator.prepare(model, optimizer, dl)
    accelerator.checkpoint_on_preemption()
    step = 0
    plan.arm_save(lambda: step)
    while step < STEPS:
        for batch in dl:
            plan.reached("batch", step)
            accelerator.backward(model(batch["input_ids"]).square().mean())
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            plan.stepped(step)
            if step % SAVE_EVERY == 0:
                accelerator.save_state()
            if step == STEPS:
                break


def main() -> None:
    out, loop, workers, kill_step, kill_at = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    plan = Plan(out, kill_step, kill_at)
    {"trainer": train_with_trainer, "hand": train_by_hand}[loop](out, workers, plan)
    plan.log.write("finished\n")


if __name__ == "__main__":
    main()
