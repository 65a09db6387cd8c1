"""A language-model training loop on a pretraining pipeline: kill it at any moment, run the same command again.

Three tokenized sources (a 🤗 ``datasets`` stream behind its own shuffle buffer, a map-style dataset and an
iterable one) are mixed by weight, packed into rows of ``SEQ + 1`` tokens and read by DataLoader workers; a
tiny causal LM trains on them with gradient accumulation, evaluates on a held-out set every few steps and saves
a checkpoint every few steps. Everything the run reads is written under ``--out`` first, so nothing is
downloaded::

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 examples/lm_pipeline.py --out runs/lm

Run it again after a kill, on the same or another number of processes (``--num_processes 3``) and workers
(``--num-workers 0``): it resumes from the newest complete checkpoint and trains exactly the rows, losses and
weights of the uninterrupted run (the global batch is kept at ``GLOBAL_BATCH`` rows on 1, 2, 3 or 6
processes). To check it (``docs/check-resume.md``)::

    accelerate-stateful check-resume --kills 10 --chain 10 --processes 2,3 --workers 0,2 -- \\
        env ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 $PWD/examples/lm_pipeline.py
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, Optional

import torch
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
from torch.utils.data import DataLoader

from accelerate_stateful import Accelerator, Mixture, Packed, exact_shuffle

SEQ = 16  # tokens a row predicts: a packed row holds SEQ + 1
VOCAB = 512
GLOBAL_BATCH = 12  # rows per optimizer step, over all processes and both micro-batches
ACCUMULATE = 2
WEIGHTS = {"web": 0.5, "books": 0.3, "code": 0.2}
DOCUMENTS_PER_EPOCH = 200  # each epoch mixes this many documents (sources read again from their start)


def document(source: str, number: int) -> list[int]:
    """The token ids of document ``number`` of ``source``: fixed, so every run reads the same data."""
    base = {"web": 2, "books": 200, "code": 400}[source]
    length = 3 + (number * 7 + len(source)) % 13
    return [base + (number * 31 + 5 * j) % 100 for j in range(length)]


def write_data(folder: Path) -> None:
    """The web source as JSON-lines shards, written once (atomically: a kill mid-write leaves no half file)."""
    folder.mkdir(parents=True, exist_ok=True)
    for shard in range(2):
        path = folder / f"web-{shard}.jsonl"
        if not path.exists():
            partial = path.with_suffix(f".tmp{os.getpid()}")
            partial.write_text("".join(json.dumps({"input_ids": document("web", 2 * n + shard)}) + "\n"
                                       for n in range(200)))
            partial.replace(path)


def pipeline(folder: Path, seed: int) -> Packed:
    """Mixed by weight, packed into rows: the package's composable sources (docs/sources/lm-pipelines.md)."""
    import datasets

    datasets.disable_progress_bars()
    web = datasets.load_dataset("json", data_files=sorted(str(p) for p in folder.glob("web-*.jsonl")),
                                split="train", streaming=True)
    books = datasets.Dataset.from_dict({"input_ids": [document("books", n) for n in range(120)]})
    code = datasets.Dataset.from_dict({"input_ids": [document("code", n) for n in range(90)]}).to_iterable_dataset()
    mixture = Mixture({"web": exact_shuffle(web.shuffle(seed=seed, buffer_size=32)), "books": books, "code": code},
                      WEIGHTS, seed=seed, on_exhausted="restart", samples_per_epoch=DOCUMENTS_PER_EPOCH)
    return Packed(mixture, seq_len=SEQ + 1)


class TinyLM(torch.nn.Module):
    """An embedding and a linear layer: the next token from the current one (enough to have a loss to follow)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


def lm_loss(model: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    logits = model(rows[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), rows[:, 1:].reshape(-1))


class Progress:
    """The optimizer steps taken, saved in every checkpoint (``register_for_checkpointing``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def evaluate(accelerator: Accelerator, model: torch.nn.Module, loader: Any) -> float:
    model.eval()
    losses = []
    with torch.no_grad():
        for batch in loader:
            losses.append(accelerator.gather_for_metrics(lm_loss(model, batch["input_ids"]).reshape(1)))
    model.train()
    return torch.cat(losses).mean().item()


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/lm"), help="data, checkpoints and the log")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--num-workers", type=int, default=2, help="data-loading workers per process")
    parser.add_argument("--save-every", type=int, default=3, help="checkpoint every N optimizer steps")
    parser.add_argument("--eval-every", type=int, default=5, help="evaluate every N optimizer steps")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    accelerator = Accelerator(
        gradient_accumulation_steps=ACCUMULATE,
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
        project_config=ProjectConfiguration(project_dir=str(args.out), automatic_checkpoint_naming=True,
                                            total_limit=2),
    )
    per_rank = GLOBAL_BATCH // (ACCUMULATE * accelerator.num_processes)
    if per_rank * ACCUMULATE * accelerator.num_processes != GLOBAL_BATCH:
        raise SystemExit(f"run it on 1, 2, 3 or 6 processes: {GLOBAL_BATCH} rows a step are shared between them")
    with accelerator.main_process_first():
        write_data(args.out / "data")
    set_seed(args.seed)  # the model's first weights; a resume loads the trained ones over them
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train = DataLoader(pipeline(args.out / "data", args.seed), batch_size=per_rank, num_workers=args.num_workers,
                       drop_last=True)
    held_out = [{"input_ids": torch.tensor((document("books", 1000 + n) * SEQ)[: SEQ + 1])} for n in range(10)]
    model, optimizer, train, held_out = accelerator.prepare(
        model, optimizer, train, DataLoader(held_out, batch_size=per_rank * ACCUMULATE))
    progress = Progress()
    accelerator.register_for_checkpointing(progress)

    resumed = accelerator.resume()  # the newest complete checkpoint, or None on a fresh start
    accelerator.print(f"[lm] {'resumed from ' + resumed.name if resumed else 'fresh start'}: step {progress.step},"
                      f" epoch {train.epoch}, {accelerator.num_processes} process(es)")
    for _ in range(train.epoch, args.epochs):
        for batch in train:
            with accelerator.accumulate(model):
                loss = lm_loss(model, batch["input_ids"])
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            progress.step += 1
            if progress.step % args.eval_every == 0:
                accelerator.print(f"[lm] step {progress.step}: held-out loss {evaluate(accelerator, model, held_out):.4f}")
            if progress.step % args.save_every == 0:
                accelerator.save_state()
    accelerator.print(f"[lm] done: {progress.step} steps")
    accelerator.end_training()


if __name__ == "__main__":
    main()
