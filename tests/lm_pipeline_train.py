"""A language-model data pipeline under ``accelerate launch``: trained, killed, resumed elsewhere (issue 20).

The pipeline is ``Packed(Mixture({...}), seq_len=8)`` over three sources: ``table`` (map-style: a list of
documents), ``web`` (a ``datasets.IterableDataset`` streamed from two local json shards and shuffled with a
buffer, through ``exact_shuffle``) and ``code`` (a stateful iterable of our own). Every token names its
source, document and offset (:func:`token`), so the rows a run delivered say which documents of which
source they hold.

Usage (``tests/test_lm_pipeline_mp.py`` builds the command and the data)::

    accelerate launch ... tests/lm_pipeline_train.py OUT LAUNCH WORKERS KILL_AT WEIGHTS_JSON [SKIP_JSON]

Each rank resumes the newest checkpoint under ``OUT/run``, trains a tiny model on the rows, saves every
``SAVE_EVERY`` steps, and appends what it did to ``OUT/launch<LAUNCH>_rank<R>.jsonl``: the step it resumed
at, each step's rows, each save, and ``done`` at the end of the data. After step ``KILL_AT`` (``-1``: never)
it writes ``OUT/kill<LAUNCH>`` and waits to be killed. ``SKIP_JSON`` (``[start, stop]``): rows of those
global indices are left out after the resume (``loader.skip_samples``), as after a loss spike.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import datasets
import torch
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
from torch.utils.data import DataLoader, IterableDataset

import mp_harness_rank
from accelerate_stateful import Accelerator
from accelerate_stateful.sources import Mixture, Packed, exact_shuffle

SOURCES = ("table", "web", "code")
DOCS, SEQ_LEN, BATCH, SAVE_EVERY, SEED = 60, 8, 2, 3, 11
WEIGHTS = {"table": 0.5, "web": 0.3, "code": 0.2}


def token(source: str, doc: int, offset: int) -> int:
    return SOURCES.index(source) * 1_000_000 + doc * 100 + offset


def decode(value: int) -> tuple[str, int, int]:
    return SOURCES[value // 1_000_000], value % 1_000_000 // 100, value % 100


def document(source: str, doc: int) -> dict:
    length = 1 + (doc * 7 + SOURCES.index(source) * 3) % 13  # 1 to 13 tokens: some span two rows
    return {"input_ids": [token(source, doc, offset) for offset in range(length)]}


class CodeStream(IterableDataset):
    """A stateful iterable read in order; its position is the next document."""

    def __init__(self) -> None:
        self.next = 0

    def __iter__(self):
        while self.next < DOCS:
            self.next += 1
            yield document("code", self.next - 1)

    def state_dict(self) -> dict:
        return {"next": self.next}

    def load_state_dict(self, state: dict) -> None:
        self.next = int(state["next"])


def write_web_shards(folder: Path) -> list[str]:
    """The web source's two json shards (the test writes them once, before any launch)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard in range(2):
        path = folder / f"web-{shard}.jsonl"
        lines = [json.dumps(document("web", doc)) for doc in range(shard, DOCS, 2)]
        path.write_text("\n".join(lines) + "\n")
        paths.append(str(path))
    return paths


def web_stream(folder: Path):
    paths = sorted(str(p) for p in folder.glob("web-*.jsonl"))
    stream = datasets.load_dataset("json", data_files=paths, split="train", streaming=True)
    return exact_shuffle(stream.shuffle(seed=5, buffer_size=8))


def pipeline(data: Path, weights: dict) -> Packed:
    table = [document("table", doc) for doc in range(DOCS)]
    sources = {"table": table, "web": web_stream(data), "code": CodeStream()}
    return Packed(Mixture(sources, weights, seed=SEED), seq_len=SEQ_LEN)


class Steps:
    """The step counter, in the checkpoint (``register_for_checkpointing``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def main(out: Path, launch: int, workers: int, kill_at: int, weights: str, skip: str = "") -> None:
    accelerator = Accelerator(
        cpu=True,
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
        project_config=ProjectConfiguration(project_dir=str(out / "run"), automatic_checkpoint_naming=True),
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(SEQ_LEN, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-9)
    loader = DataLoader(pipeline(out / "data", json.loads(weights)), batch_size=BATCH, num_workers=workers,
                        drop_last=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    steps = Steps()
    accelerator.register_for_checkpointing(steps)
    resumed = accelerator.resume()
    if skip:
        loader.skip_samples(*json.loads(skip))
    log = open(out / f"launch{launch}_rank{accelerator.process_index}.jsonl", "a")

    def record(**entry) -> None:
        log.write(json.dumps(entry) + "\n")
        log.flush()

    record(resumed=None if resumed is None else resumed.name, step=steps.step, world=accelerator.num_processes)
    for batch in loader:
        steps.step += 1
        rows = batch["input_ids"]
        record(step=steps.step, rows=rows.tolist())
        loss = model(rows.float() / 1e6).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if steps.step % SAVE_EVERY == 0:
            accelerator.save_state()
            record(saved=steps.step)
        if steps.step == kill_at:
            if accelerator.is_main_process:
                (out / f"kill{launch}").write_text(str(steps.step))
            time.sleep(600)  # the test kills the whole job here
    record(done=steps.step)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    mp_harness_rank.run(main, Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:])
