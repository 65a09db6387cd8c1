"""The 🤗 side: ``datasets.IterableDataset.state_dict()`` and the stock ``transformers.Trainer``.

- 🤗 datasets (the "Stream" guide, "Save a dataset checkpoint and resume iteration"): ``ds.state_dict()`` is
  saved with the epoch and given back to ``ds.load_state_dict()`` before iterating, the dataset read by a
  ``torch.utils.data.DataLoader`` with no workers; with workers the guide says to use torchdata's
  ``StatefulDataLoader`` and save its ``state_dict()`` instead. The dataset is ``Dataset.from_dict(...)
  .to_iterable_dataset(num_shards=4)``, then ``.shuffle(seed=0, buffer_size=8)``, or two halves
  ``interleave_datasets``-ed (``probabilities=[0.5, 0.5], seed=0``), or ``.filter(id % 3 != 0)``;
  ``set_epoch(epoch)`` starts each epoch.
- Trainer (its "Checkpoints" guide): ``trainer.train(resume_from_checkpoint=True)`` resumes the newest
  ``checkpoint-N`` under ``output_dir``; the kill is a save at that step and ``should_training_stop``.
"""

from __future__ import annotations

import contextlib
import io
import time
from pathlib import Path
from typing import Optional

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from peers_torch import _reset_accelerate, world
from scenarios import EPOCHS, Scenario, seed_everything, source_ids

VARIANTS = ("plain", "shuffled", "interleaved", "filtered")


def _slow(row: dict, cost_s: float) -> dict:
    time.sleep(cost_s)
    return row


def hf_stream(variant: str, scenario: Scenario, cost_s: float = 0.0, column: str = "id"):
    import datasets

    def one(ids):
        ds = datasets.Dataset.from_dict({column: ids}).to_iterable_dataset(num_shards=4)
        if cost_s:
            ds = ds.map(_slow, fn_kwargs={"cost_s": cost_s})
        if variant == "shuffled":
            ds = ds.shuffle(seed=0, buffer_size=8)
        if variant == "filtered":
            ds = ds.filter(lambda row: row[column] % 3 != 0)
        return ds

    sources = source_ids(scenario)
    if len(sources) == 1 and variant == "interleaved":
        sources = [sources[0][0::2], sources[0][1::2]]
    if len(sources) == 1:
        return one(sources[0])
    return datasets.interleave_datasets([one(s) for s in sources], probabilities=[0.5, 0.5], seed=0)


def datasets_segment(variant: str, scenario: Scenario, folder: Path, segment: int, stop: Optional[int],
                     on_first=None, cost_s: float = 0.0) -> list:
    from torchdata.stateful_dataloader import StatefulDataLoader

    seed_everything()
    ds = hf_stream(variant, scenario, cost_s)
    rank, processes = world()
    if processes > 1:  # the guide's way to split a stream between processes
        from datasets.distributed import split_dataset_by_node

        ds = split_dataset_by_node(ds, rank=rank, world_size=processes)
    with_workers = scenario.workers > 0
    dl = (StatefulDataLoader if with_workers else DataLoader)(
        ds, batch_size=scenario.batch(segment), num_workers=scenario.workers)
    path, start_epoch = folder / "state.pt", 0
    if path.exists():
        saved = torch.load(path, weights_only=False)
        (dl if with_workers else ds).load_state_dict(saved["state"])
        start_epoch = saved["epoch"]
    trained, done = [], 0
    for epoch in range(start_epoch, EPOCHS):
        ds.set_epoch(epoch)
        for batch in dl:
            if on_first is not None:
                return on_first()
            trained += [(epoch, int(i)) for i in batch["id"]]
            done += 1
            if done == stop:
                torch.save({"state": (dl if with_workers else ds).state_dict(), "epoch": epoch}, path)
                return trained
    return trained


class _Rows(Dataset):
    def __init__(self, ids, cost_s: float) -> None:
        self.ids, self.cost_s = ids, cost_s

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        if self.cost_s:
            time.sleep(self.cost_s)
        return {"input_ids": self.ids[i]}


class _RowStream(IterableDataset):
    def __init__(self, ids, cost_s: float) -> None:
        self.ids, self.cost_s = ids, cost_s

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        for i in self.ids if info is None else self.ids[info.id::info.num_workers]:
            if self.cost_s:
                time.sleep(self.cost_s)
            yield {"input_ids": i}


class _FirstBatch(Exception):
    """Raised by the model at the first batch it sees when only the time to it is measured."""


def trainer_segment(scenario: Scenario, folder: Path, segment: int, stop: Optional[int],
                    on_first=None, cost_s: float = 0.0) -> list:
    import logging

    import transformers
    from transformers import Trainer, TrainerCallback, TrainingArguments

    transformers.logging.set_verbosity_error()
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    _reset_accelerate()
    seed_everything()
    trained, now = [], {"epoch": 0, "steps": 0}

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Linear(1, 1)

        def forward(self, input_ids, **_):
            if on_first is not None:
                raise _FirstBatch
            trained.extend((now["epoch"], int(i)) for i in input_ids)
            return {"loss": self.w(input_ids.float().unsqueeze(1)).sum()}

    class Kill(TrainerCallback):
        def on_epoch_begin(self, args, state, control, **kw):
            now["epoch"] = int(round(state.epoch or 0))

        def on_step_end(self, args, state, control, **kw):
            now["steps"] += 1
            if now["steps"] == stop:
                control.should_save = control.should_training_stop = True

    sources = source_ids(scenario)
    if scenario.mixture:
        data = hf_stream("plain", scenario, cost_s, column="input_ids")
    elif scenario.stream:
        data = _RowStream(sources[0], cost_s)
    else:
        data = _Rows(sources[0], cost_s)
    stream = scenario.stream or scenario.mixture
    # A stream has no len(): the Trainer's documentation asks for max_steps, here the epochs' worth of batches.
    per_epoch = -(-sum(1 for _ in data) // scenario.batch(segment)) if stream else 0
    args = TrainingArguments(
        output_dir=str(folder), per_device_train_batch_size=scenario.batch(segment), num_train_epochs=EPOCHS,
        max_steps=EPOCHS * per_epoch if stream else -1,
        dataloader_num_workers=scenario.workers, save_strategy="no", report_to=[], use_cpu=True, seed=0,
        logging_strategy="no", disable_tqdm=True, learning_rate=0.01)
    trainer = Trainer(model=Net(), args=args, train_dataset=data, callbacks=[Kill()])
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # its end-of-training metrics line
            trainer.train(resume_from_checkpoint=True if segment > 0 else None)
    except _FirstBatch:
        return on_first()
    return trained
