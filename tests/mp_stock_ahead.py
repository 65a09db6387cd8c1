"""Run by ``tests/test_stock_ahead_mp.py`` under ``accelerate launch`` on 2 processes: checkpoint-N past a Trainer
run's starting step, moved aside on the main process and checked on every rank.

Two output folders, each holding stock Trainer ``checkpoint-3`` and ``checkpoint-6`` (a ``trainer_state.json``
and a weights file are all a stock checkpoint ahead needs to be one): in ``refused`` the main process cannot
move ``checkpoint-6``, and both ranks must raise the same error before the first step; in ``moved`` a fresh
start moves both aside and trains to the end on both ranks. The test makes the folders (:func:`stock_folders`)
before the launch; each rank writes what it saw to ``rank<r>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import mp_harness_rank


def stock_folders(out: Path) -> None:
    for step in (3, 6):
        folder = out / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"stock weights %d" % step)
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))


def trainer(out: Path):
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from accelerate_stateful.transformers import StatefulTrainer

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1, n_head=1))
    args = TrainingArguments(str(out), report_to=[], per_device_train_batch_size=2, max_steps=4, save_steps=3,
                             logging_steps=100, seed=0, disable_tqdm=True)
    data = [{"input_ids": [i, i + 1, i + 2], "labels": [i, i + 1, i + 2]} for i in range(16)]
    return StatefulTrainer(model=model, args=args, train_dataset=data)


def main(root: Path) -> None:
    from accelerate_stateful import CheckpointError

    seen = {}
    rename = Path.rename

    def refused(self, target):  # the main process may not rename checkpoint-6 of "refused"
        if self.parent.name == "refused" and self.name == "checkpoint-6":
            raise PermissionError(13, "Permission denied", str(self))
        return rename(self, target)

    Path.rename = refused
    try:
        trainer(root / "refused").train()
        seen["refused"] = "trained"
    except CheckpointError as exc:
        seen["refused"] = str(exc)
    finally:
        Path.rename = rename
    done = trainer(root / "moved")
    done.train()
    seen["moved"] = {"global_step": done.state.global_step,
                     "listing": sorted(p.name for p in (root / "moved").iterdir() if p.name.startswith("checkpoint-")),
                     "aside": sorted(p.relative_to(root / "moved").as_posix()
                                     for p in (root / "moved").glob("superseded-*/*"))}
    (root / f"rank{done.args.process_index}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    mp_harness_rank.run(main, Path(sys.argv[1]))
