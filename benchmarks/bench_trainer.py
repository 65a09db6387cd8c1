"""Trainer resume: time from ``train(resume_from_checkpoint=True)`` to the first optimizer step, stock vs ours.

An iterable dataset whose items cost ~1 ms each (a sleep: think of a remote read or a decode) is trained
to 10 %, 50 % and 90 % of its epoch and checkpointed there, once with ``transformers.Trainer`` and once
with ``StatefulTrainer``; then each resumes from its checkpoint and we time the first optimizer step and
count the items the dataset produced before it. Stock Trainer reads and throws away every batch up to
the position (``skip_first_batches``); ours restores the stream's position and reads nothing extra.
Both run side by side in this one process, alternating which goes first, with one process and no workers.

The per-step cost of the preemption checkpoint is measured by ``benchmarks/bench_preemption.py``.
"""

from __future__ import annotations

import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch.utils.data import IterableDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import no_gc, rotated, run_main, table  # noqa: E402

QUICK = {"items": 240, "batch": 4, "rounds": 1}
FULL = {"items": 1000, "batch": 4, "rounds": 2}
POSITIONS = (0.1, 0.5, 0.9)


class SlowStream(IterableDataset):
    """A stateful stream of ``n`` token rows, each taking ``cost_s`` to produce; counts what it produced."""

    def __init__(self, n: int, cost_s: float = 0.001) -> None:
        self.n, self.cost_s, self.pos, self.produced = n, cost_s, 0, 0

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]

    def __iter__(self):
        while self.pos < self.n:
            time.sleep(self.cost_s)
            self.produced += 1
            self.pos += 1
            yield {"input_ids": [2 + (self.pos * k) % 60 for k in range(1, 9)]}


def collate(rows: list[dict]) -> dict:
    ids = torch.tensor([r["input_ids"] for r in rows])
    return {"input_ids": ids, "labels": ids.clone()}


def _trainer(kind: str, out: Path, stream: SlowStream, max_steps: int, save_steps: int, batch: int,
             on_step: Optional[Callable]):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from accelerate_stateful.integrations.transformers import StatefulTrainer

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    args = TrainingArguments(str(out), per_device_train_batch_size=batch, max_steps=max_steps, save_steps=save_steps,
                             save_strategy="steps", logging_steps=10_000, report_to=[], disable_tqdm=True,
                             dataloader_num_workers=0, use_cpu=True)
    cls = StatefulTrainer if kind == "ours" else Trainer
    trainer = cls(model=model, args=args, train_dataset=stream, data_collator=collate)
    if on_step is not None:
        class First(TrainerCallback):
            def on_optimizer_step(self, args, state, control, **kwargs):
                on_step()

        trainer.add_callback(First())
    return trainer


def train_to(kind: str, out: Path, items: int, batch: int, steps: int, save_steps: int) -> None:
    """Train ``steps`` optimizer steps, writing ``checkpoint-N`` every ``save_steps``."""
    _trainer(kind, out, SlowStream(items), steps, save_steps, batch, None).train()


def resume_from(kind: str, checkpoint: Path, out: Path, items: int, batch: int) -> tuple[float, int]:
    """Seconds from ``train(resume_from_checkpoint=True)`` to the first optimizer step, and items produced.

    ``checkpoint`` is copied alone into ``out``, so ``True`` finds it there as the newest.
    """
    shutil.copytree(checkpoint, out / checkpoint.name)
    at = int(checkpoint.name.split("-")[1])
    stream, first = SlowStream(items), []
    trainer = _trainer(kind, out, stream, at + 1, at + 1, batch,
                       lambda: first.append(time.perf_counter()) if not first else None)
    with no_gc():
        started = time.perf_counter()
        trainer.train(resume_from_checkpoint=True)
    return first[0] - started, stream.produced


def resume_time(kind: str, root: Path, items: int, batch: int, fraction: float) -> tuple[float, int]:
    """``resume_from`` a checkpoint taken at ``fraction`` of the stream."""
    at = max(1, round(fraction * items / batch))
    train_to(kind, root / f"{kind}-{fraction}", items, batch, at, at)
    return resume_from(kind, root / f"{kind}-{fraction}" / f"checkpoint-{at}", root / f"{kind}-{fraction}-resumed",
                       items, batch)


def measure(sizes: dict, started: float) -> Callable[[dict], str]:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(1)  # a tiny model: more threads only contend (a loaded machine made steps 100x slower)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        steps = sizes["items"] // sizes["batch"]
        every = max(1, round(0.1 * steps))
        best: dict[tuple[str, float], tuple[float, int]] = {}
        for round_index in range(sizes["rounds"]):
            for kind in rotated(("stock", "ours"), round_index):
                run = Path(tmp) / f"{kind}-{round_index}"
                train_to(kind, run, sizes["items"], sizes["batch"], round(0.9 * steps / every) * every, every)
                for fraction in POSITIONS:
                    checkpoint = run / f"checkpoint-{round(fraction * steps / every) * every}"
                    seconds, produced = resume_from(kind, checkpoint, Path(tmp) / f"{kind}-{round_index}-{fraction}",
                                                    sizes["items"], sizes["batch"])
                    if (kind, fraction) not in best or seconds < best[kind, fraction][0]:
                        best[kind, fraction] = (seconds, produced)
        for fraction in POSITIONS:
            (stock_s, stock_n), (ours_s, ours_n) = best["stock", fraction], best["ours", fraction]
            rows.append([f"{fraction:.0%}", f"{stock_s:.3f}", str(stock_n), f"{ours_s:.3f}", str(ours_n),
                         f"{stock_s / ours_s:.1f}x"])

    def render(env: dict) -> str:
        lines = ["## Trainer: resume of an iterable dataset (1 ms per item)", ""]
        lines += [f"- {k}: {v}" for k, v in env.items()]
        lines += ["", f"{sizes['items']} items per epoch, batch {sizes['batch']}, best of {sizes['rounds']} rounds.", ""]
        lines += table(["resumed at", "stock s to 1st step", "stock items read", "ours s to 1st step",
                        "ours items read", "stock / ours"], rows)
        return "\n".join(lines) + "\n"

    return render


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_main(argv, __doc__, "240 items, 1 round", (QUICK, FULL), measure)


if __name__ == "__main__":
    sys.exit(main())
