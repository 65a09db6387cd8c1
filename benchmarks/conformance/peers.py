"""The rows of the table: one entry per loader. Adding a loader (litdata, mosaicml-streaming) is one entry here
and one ``segment`` function: a process's life that builds the loader, resumes if the folder holds a
checkpoint, trains ``stop`` batches (``None``: to the end) and saves there, returning ``[(epoch, id), ...]``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
from typing import Callable, Optional

import peers_hf
import peers_streaming
import peers_torch
from scenarios import Scenario


MODULES = {"mosaicml-streaming": "streaming", "accelerate-stateful": "accelerate_stateful"}  # a distribution whose module has another name


@dataclasses.dataclass(frozen=True)
class Peer:
    name: str
    packages: tuple[str, ...]  # the distributions whose releases its results are pinned to
    how: str  # how it is used, after which documentation
    segment: Optional[Callable] = None  # None: not written yet
    not_applicable: Callable[[Scenario], Optional[str]] = lambda scenario: None
    owns_processes: bool = False  # starts torch.distributed itself: a launch of its own

    def missing(self) -> Optional[str]:
        """Why this row cannot be measured on this machine (``None``: it can)."""
        absent = [p for p in self.packages if importlib.util.find_spec(MODULES.get(p, p)) is None]
        if absent:
            return f"{', '.join(absent)} is not installed here"
        return None if self.segment else "its scenarios are not written yet"

    def versions(self) -> dict:
        found = {}
        for package in self.packages:
            try:
                found[package] = importlib.metadata.version(package)
            except importlib.metadata.PackageNotFoundError:
                found[package] = None
        return found


def _hf_na(scenario: Scenario) -> Optional[str]:
    if scenario.key in ("map-mid", "map-mid-w2"):
        return "a map-style Dataset has no state_dict() (see the stream columns)"
    return None


def _stream_na(scenario: Scenario) -> Optional[str]:
    if scenario.key in ("map-mid", "map-mid-w2"):
        return "a stream of written chunks, no map-style form (see the stream columns)"
    return None


def _trainer_na(scenario: Scenario) -> Optional[str]:
    if scenario.accumulation > 1:
        return "the Trainer saves only after an optimizer step, never inside an accumulation window"
    return None


PEERS = (
    Peer("ours (accelerate_stateful)", ("accelerate-stateful", "accelerate", "torch"),
         "accelerate_stateful.Accelerator, use_stateful_dataloader=True, accelerator.resume()",
         functools.partial(peers_torch.accelerate_segment, "ours"), owns_processes=True),
    Peer("Accelerate, use_stateful_dataloader", ("accelerate", "torchdata"),
         "accelerate.Accelerator, use_stateful_dataloader=True, save_state/load_state",
         functools.partial(peers_torch.accelerate_segment, "stateful"), owns_processes=True),
    Peer("Accelerate, skip_first_batches", ("accelerate",),
         "accelerate.Accelerator, load_state, then skip_first_batches(resume_step) (complete_nlp_example.py)",
         functools.partial(peers_torch.accelerate_segment, "skip"), owns_processes=True),
    Peer("torchdata StatefulDataLoader", ("torchdata",),
         "StatefulDataLoader.state_dict()/load_state_dict(), DistributedSampler on several processes",
         peers_torch.torchdata_segment),
    *(Peer(f"🤗 datasets IterableDataset, {variant}", ("datasets", "torchdata"),
           "IterableDataset.state_dict() in a DataLoader; StatefulDataLoader.state_dict() with workers",
           functools.partial(peers_hf.datasets_segment, variant), _hf_na)
      for variant in peers_hf.VARIANTS),
    Peer("🤗 Trainer", ("transformers",), "Trainer.train(resume_from_checkpoint=True)",
         peers_hf.trainer_segment, _trainer_na, owns_processes=True),
    Peer("litdata StreamingDataLoader", ("litdata",),
         "StreamingDataset(shuffle=True, drop_last=True) + StreamingDataLoader.state_dict()/load_state_dict()",
         peers_streaming.litdata_segment, _stream_na, owns_processes=True),
    Peer("mosaicml-streaming StreamingDataset", ("mosaicml-streaming",),
         "StreamingDataset(shuffle=True, batch_size=B) + StreamingDataLoader.state_dict()/load_state_dict()",
         peers_streaming.mosaic_segment, _stream_na, owns_processes=True),
)
