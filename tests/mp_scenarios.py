"""Real multi-process resume scenarios, many per launch; run under ``accelerate launch``.

Two families of sets: ``SCENARIO_SETS`` (map-style data, each rank reading its shard) and
``SOURCE_SETS`` (the dispatcher over map-style data and over iterable datasets, and iterable datasets
read by every rank: stateful streams, and opaque ones that resume by fast-forwarding; Hugging Face
``datasets`` sources, map-style and iterable; and a ``RoundRobinDataset`` whose source is read in one place).

Usage (``test_multiprocess.py`` builds this command; with one process, ``--cpu`` replaces
``--multi_gpu``, which needs two or more)::

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N --num_machines 1 \
        --mixed_precision no --dynamo_backend no tests/mp_scenarios.py OUT_DIR SET_NAME [SCENARIO_IDS]

For each scenario of ``ALL_SETS[SET_NAME]`` every rank runs:

1. a *reference*: three epochs uninterrupted, with a real ``accumulate``
   training step, recording per batch the epoch, this rank's sample ids,
   ``sync_gradients``, ``end_of_dataloader``, ``batches_yielded`` and, on an
   epoch's last batch, ``gather_for_metrics(ids)`` (a batch that is a dict gives its ``"id"`` entry);
   across ranks each epoch must deliver every sample once, with the padding dropped by the gather;
   without shuffling, the same run through Accelerate's own loader (``use_stateful_dataloader=False``)
   must give every rank the same batches, ``end_of_dataloader`` and ``len()`` (drop-in equivalence;
   not for a ``RoundRobinDataset``, which Accelerate has no loader for);
2. a *saver*: the same run, checkpointing at every save point into its own
   folder; it must still equal the reference (saving disturbs nothing);
3. one *resume* per checkpoint: everything rebuilt (``Accelerator``,
   ``DataLoader``, model, optimizer, ``GradientState``, global RNG),
   ``load_state``, run to the end: the batches before the save plus those
   after the resume must equal the reference. A resumed run may checkpoint
   again, which makes chains of 2 and 3 successive resumes. An iterable
   dataset's loader must report ``replayed_samples`` > 0 (with a warning
   naming the dataset class) after resuming an opaque stream mid-epoch, and
   0 for a stateful stream or at an epoch boundary.

Each rank writes ``OUT_DIR/rank<R>.json`` (rewritten after every scenario):
one entry per scenario with ``id``, ``passed`` and ``difference`` (the
first difference in words, or the traceback). A scenario whose runs differ
does not stop the launch: ranks keep running the same collectives and only
record what differs. A scenario that raises on a rank is recorded there and
ends the launch on every rank (``mp_harness_rank.run``): the other ranks may be
waiting in a collective the raising rank will never reach.

``SCENARIO_IDS`` (a comma-separated list) runs those scenarios of the set only, in the set's order: the soak
(``soak.py --kind scenarios``) runs a few per launch.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import accelerate
import torch
import torch.distributed as dist
from accelerate.state import GradientState, PartialState
from accelerate.utils import DataLoaderConfiguration, DistributedType, ProjectConfiguration, gather_object
from torch.distributed.algorithms.join import Join
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, SequentialSampler

import accelerate_stateful
from accelerate_stateful import DispatchDataLoader
from accelerate_stateful.checkpoint import _files
import mp_harness_rank
from mp_loops import LOOP_IDS, run_loop_case
from streams import CountingStream, OpaqueStream, OpenOnce, decode

EPOCHS = 3
# A desync fails in two minutes instead of hanging for gloo's default half hour (30 s timed out now and then
# on a loaded 2-core machine, where one rank can fall that far behind another). The harness's watchdog dumps
# every stack at 3/4 of it.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=mp_harness_rank.collective_timeout_s(120))
FRESH_SEED = 7  # what `set_seed` at the top of a script does; resumed runs get other seeds

# A save point, counted from the run's start: ("start",) before the first batch (or right after
# loading), ("in", epoch, k) right after the k-th batch of that epoch inside the loop, ("after", epoch)
# after that epoch's inner loop ended, ("done",) after the epoch loop ended.
SavePoint = tuple


def _scenario(sid: str, *, n: int, bs: int, shuffle: str = "off", drop_last: bool = False, even: bool = True,
              split: bool = False, workers: int = 0, ga: int = 1, skip: int = 0, auto: bool = False,
              data: str = "map", dispatch: Optional[bool] = None, persistent: bool = False,
              bsampler: bool = False) -> dict:
    """One scenario. ``data`` names a dataset of ``DATASETS``; ``dispatch`` is ``dispatch_batches`` (``None``:
    Accelerate's default, the dispatcher for an iterable dataset, each rank its shard for a map-style one)."""
    return dict(id=sid, n=n, bs=bs, shuffle=shuffle, drop_last=drop_last, even=even, split=split,
                workers=workers, ga=ga, skip=skip, auto=auto, data=data, dispatch=dispatch,
                persistent=persistent, bsampler=bsampler)


# One covering set per world size. Within a set, every pair of values of the two-valued factors
# (num_workers 0/2, shuffle off/on, drop_last, even_batches, split_batches, gradient accumulation 1/2)
# occurs in some row (``test_scenario_sets_cover_every_pair`` checks it); the full product would be 64
# rows. Dataset lengths are never a multiple of the global batch. num_workers=2 is in two rows only:
# each epoch of those forks two workers per rank. shuffle="drawn" shuffles without a generator: the
# seed is drawn from the global RNG, which differs across ranks, so the ranks must agree on rank 0's.
# Ranks with different batch counts (even_batches=False) train with gradient accumulation 1 only: with
# more, the rank at its epoch's end syncs gradients while the other accumulates, and DDP deadlocks (so
# it does with Accelerate's own loader).
SCENARIO_SETS: dict[str, list[dict]] = {
    "world1": [
        _scenario("w1-seq-workers2-drop-split-ga2", n=23, bs=4, drop_last=True, split=True, workers=2, ga=2),
        _scenario("w1-gen-workers2-uneven", n=22, bs=3, shuffle="generator", even=False, workers=2),
        _scenario("w1-seq-auto", n=13, bs=3, auto=True),
        _scenario("w1-drawn-uneven-split-ga2", n=21, bs=4, shuffle="drawn", even=False, split=True, ga=2),
        _scenario("w1-gen-drop-split-skip", n=19, bs=2, shuffle="generator", drop_last=True, split=True,
                  skip=2),
        _scenario("w1-seq-drop-uneven-ga2", n=17, bs=5, drop_last=True, even=False, ga=2),
        # a user's batch_sampler (BatchSamplerDataLoader), dealt as Accelerate's BatchSamplerShard deals it
        _scenario("w1-bsampler-workers2", n=17, bs=3, workers=2, bsampler=True),
    ],
    "world2": [
        _scenario("w2-seq-workers2-drop-split-ga2", n=27, bs=4, drop_last=True, split=True, workers=2, ga=2),
        # rank 1 gets one batch fewer per epoch
        _scenario("w2-gen-workers2-uneven", n=21, bs=2, shuffle="generator", even=False, workers=2),
        _scenario("w2-seq-auto", n=19, bs=2, auto=True),
        # equal batch counts, a shorter last batch on rank 1
        _scenario("w2-drawn-uneven-split-ga2", n=23, bs=4, shuffle="drawn", even=False, split=True, ga=2),
        _scenario("w2-gen-drop-split-skip", n=23, bs=2, shuffle="generator", drop_last=True, split=True,
                  skip=2),
        _scenario("w2-seq-drop-uneven-ga2", n=29, bs=3, drop_last=True, even=False, ga=2),
        _scenario("w2-bsampler-workers2-split", n=21, bs=4, workers=2, split=True, bsampler=True),
        _scenario("w2-bsampler-gen-drop", n=23, bs=3, shuffle="generator", drop_last=True, bsampler=True),
    ],
    "world3": [
        _scenario("w3-seq-workers2-drop-split-ga2", n=31, bs=3, drop_last=True, split=True, workers=2, ga=2),
        # ranks 1 and 2 get one batch fewer per epoch
        _scenario("w3-gen-workers2-uneven", n=20, bs=2, shuffle="generator", even=False, workers=2),
        _scenario("w3-seq-auto", n=23, bs=2, auto=True),
        # equal batch counts, a shorter last batch on rank 2
        _scenario("w3-drawn-uneven-split-ga2", n=29, bs=6, shuffle="drawn", even=False, split=True, ga=2),
        _scenario("w3-gen-drop-split-skip", n=25, bs=3, shuffle="generator", drop_last=True, split=True,
                  skip=2),
        _scenario("w3-seq-drop-uneven-ga2", n=32, bs=3, drop_last=True, even=False, ga=2),
        _scenario("w3-bsampler-workers2", n=22, bs=2, workers=2, bsampler=True),
    ],
}


def _source(sid: str, *, data: str, dispatch: Optional[bool], **settings: Any) -> dict:
    return _scenario(sid, data=data, dispatch=dispatch, **settings)


# The dispatcher over map-style data ("dmap"), the dispatcher over an iterable dataset (Accelerate's
# default for one: "diter") and every rank reading the stream itself with dispatch_batches=False ("siter").
# Per launch each of the three runs once without workers and once with two; across the three launches
# every pair of values of num_workers, split_batches and drop_last occurs for each of them
# (``test_source_sets_cover_every_pair``). Opaque streams (no state_dict) resume by fast-forwarding, in
# both modes and with workers. "sized-" datasets have a len(), which is what lets gather_for_metrics
# drop the padding of an iterable's last batch in shard mode; the dispatcher knows its padding without it.
# Lengths leave an uneven last step; a stream is split between the workers by id (i % workers). Worker
# processes are slow to start on two cores, so most scenarios with workers in the larger launches keep them
# (persistent_workers=True), which forks them once per run instead of once per epoch.
#
# Each launch also runs Hugging Face ``datasets`` sources and a round-robin source
# (``test_source_sets_run_hf_datasets_and_round_robin`` checks what the three launches cover together):
# - "hf-table", a map-style ``datasets.Dataset`` shuffled by the DataLoader, each rank reading its shard and
#   dispatched, with and without workers;
# - "hf-stream-K", a ``datasets.IterableDataset`` of K shards, dispatched (Accelerate's default) and read by
#   every rank: by whole shards where K >= the number of processes, by slices of each global batch where
#   K < it; "-shuffled" ones shuffle the order of their shards (see ``hf_stream`` for why only that, and only
#   without workers);
# - "round-robin", a ``RoundRobinDataset`` whose source fails if it is opened twice in a pass, in a worker or
#   on another rank than 0, with its per-sample transform in two workers: on one process its own loader
#   (dispatch_batches=False), on several the dispatcher.
SOURCE_SETS: dict[str, list[dict]] = {
    "sources-world1": [
        _source("w1-dmap-seq-ga2-skip", data="map", dispatch=True, n=13, bs=3, ga=2, skip=2),
        _source("w1-dmap-persistent2-split-drop", data="map", dispatch=True, n=14, bs=4, workers=2, split=True,
                drop_last=True, persistent=True),
        _source("w1-diter-sized-auto", data="sized-stream", dispatch=None, n=11, bs=2, auto=True),
        _source("w1-diter-workers2-split-drop-ga2", data="stream", dispatch=None, n=17, bs=3, workers=2,
                split=True, drop_last=True, ga=2),
        _source("w1-siter-opaque-ga2", data="sized-opaque", dispatch=False, n=11, bs=3, ga=2),
        _source("w1-siter-sized-workers2-split-drop", data="sized-stream", dispatch=False, n=19, bs=2, workers=2,
                split=True, drop_last=True),
        _source("w1-shard-hf-table-gen-workers2", data="hf-table", dispatch=None, n=19, bs=3, shuffle="generator",
                workers=2),
        _source("w1-diter-hf-stream6-shuffled-ga2", data="hf-stream-6-shuffled", dispatch=None, n=17, bs=3, ga=2),
        # each worker reads two whole shards
        _source("w1-siter-hf-stream4-workers2", data="hf-stream-4", dispatch=False, n=21, bs=2, workers=2),
        _source("w1-roundrobin-workers2-drop", data="round-robin", dispatch=False, n=23, bs=3, workers=2,
                drop_last=True),
    ],
    "sources-world2": [
        # moved by skip_first_batches to its last step, it pads that step with the epoch's first sample, as
        # Accelerate's own dispatcher does (which reads the skipped steps): compared by the parity check
        _source("w2-dmap-seq-skip", data="map", dispatch=True, n=45, bs=4, skip=2),
        # rank 1's share of the last step is padded with the epoch's first sample
        _source("w2-dmap-drawn-split-skip", data="map", dispatch=True, n=23, bs=4, shuffle="drawn", split=True,
                skip=2),
        _source("w2-dmap-persistent2-drop-ga2", data="map", dispatch=True, n=27, bs=3, workers=2, drop_last=True,
                ga=2, persistent=True),
        _source("w2-diter-opaque-workers2-drop", data="opaque", dispatch=None, n=23, bs=2, workers=2,
                drop_last=True),
        _source("w2-diter-sized-split-ga2-auto", data="sized-stream", dispatch=None, n=21, bs=4, split=True, ga=2,
                auto=True),
        _source("w2-siter-sized-split", data="sized-stream", dispatch=False, n=21, bs=4, split=True),
        _source("w2-siter-persistent2-drop-ga2", data="stream", dispatch=False, n=27, bs=2, workers=2,
                drop_last=True, ga=2, persistent=True),
        # each worker pads its own last global batch: gather_for_metrics must keep every real sample
        _source("w2-siter-sized-workers2", data="sized-stream", dispatch=False, n=22, bs=2, workers=2),
        _source("w2-dmap-hf-table-gen-workers2", data="hf-table", dispatch=True, n=21, bs=2, shuffle="generator",
                workers=2),
        # one shard for two ranks: each rank reads it whole and keeps its slice; the second worker reads nothing
        _source("w2-siter-hf-stream1-sliced-workers2", data="hf-stream-1", dispatch=False, n=19, bs=2, workers=2),
        _source("w2-roundrobin-workers2-ga2", data="round-robin", dispatch=None, n=23, bs=3, workers=2, ga=2),
    ],
    "sources-world3": [
        _source("w3-dmap-drop-ga2", data="map", dispatch=True, n=29, bs=2, drop_last=True, ga=2),
        # the last step holds one sample: ranks 1 and 2 get the epoch's first samples as padding
        _source("w3-dmap-persistent2-split", data="map", dispatch=True, n=25, bs=6, workers=2, split=True,
                persistent=True),
        _source("w3-diter-drop-ga2", data="stream", dispatch=None, n=29, bs=2, drop_last=True, ga=2),
        # a worker's last batch is short: split in three, it leaves 0 samples per rank, so it is lost, as with
        # Accelerate's dispatcher; only the epoch's last step is padded
        _source("w3-diter-sized-persistent2-split", data="sized-stream", dispatch=None, n=28, bs=3, workers=2,
                split=True, persistent=True),
        _source("w3-siter-drop-auto", data="stream", dispatch=False, n=26, bs=2, drop_last=True, auto=True),
        # no len(): gather_for_metrics keeps the last batch's padding, as it does with Accelerate's loader
        _source("w3-siter-opaque-persistent2-split-ga2", data="opaque", dispatch=False, n=25, bs=3, workers=2,
                split=True, ga=2, persistent=True),
        _source("w3-shard-hf-table-drawn", data="hf-table", dispatch=None, n=23, bs=2, shuffle="drawn"),
        _source("w3-dmap-hf-table-drawn-drop", data="hf-table", dispatch=True, n=23, bs=2, shuffle="drawn",
                drop_last=True),
        # five whole shards per rank: the rank holding the one shard of three samples gets a batch more per epoch
        _source("w3-siter-hf-stream15-shuffled-uneven", data="hf-stream-15-shuffled", dispatch=False, n=31, bs=2,
                even=False),
        _source("w3-diter-hf-stream2-workers2", data="hf-stream-2", dispatch=None, n=25, bs=2, workers=2),
        # the dispatcher reads two steps of three batches ahead, on top of the workers' prefetch
        _source("w3-roundrobin-workers2", data="round-robin", dispatch=None, n=29, bs=2, workers=2),
    ],
}

ALL_SETS: dict[str, list[dict]] = {**SCENARIO_SETS, **SOURCE_SETS}


class Ids(Dataset):
    """Sample ``i`` is the id ``i``: what the loop sees is exactly which samples it got."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class SizedCountingStream(CountingStream):
    """A stateful stream that knows its length."""

    def __len__(self) -> int:
        return self.n


class SizedOpaqueStream(OpaqueStream):
    """An opaque stream that knows its length."""

    def __len__(self) -> int:
        return self.n


def hf_table(n: int) -> Any:
    """A map-style ``datasets.Dataset`` of ids in torch format: a batch is ``{"id": tensor}``."""
    import datasets  # imported where used: most launches never need it

    return datasets.Dataset.from_dict({"id": list(range(n))}).with_format("torch")


def hf_stream(shards: int, shuffled: bool) -> Callable[[int], Any]:
    """A ``datasets.IterableDataset`` of ids in ``shards`` shards; a batch is ``{"id": tensor}``.

    Shuffled, it has ``buffer_size=1``, which shuffles the order of the shards only (``datasets`` then
    interleaves them). A larger buffer is not part of ``datasets``' state, so a resume inside it loses or
    repeats samples, and worker processes cannot resume a shuffled multi-shard stream at all (an
    ``IndexError`` inside ``datasets``, even with ``buffer_size=1``); docs/sources/hf-datasets.md says both.
    From epoch 1 on, ``datasets`` reorders the shards of any stream, shuffled or not (with at most four
    shards per reader, epoch 1 happens to keep epoch 0's order).
    """

    def make(n: int) -> Any:
        import datasets

        ds = datasets.Dataset.from_dict({"id": list(range(n))}).to_iterable_dataset(num_shards=shards)
        return ds.shuffle(seed=3, buffer_size=1) if shuffled else ds

    return make


class MainProcessSource(OpenOnce):
    """``OpenOnce`` that also fails when opened on another rank than 0: a round-robin source is read there only."""

    def __iter__(self):
        if not PartialState().is_main_process:
            raise RuntimeError(f"the source was opened on rank {PartialState().process_index}: it was replicated")
        return super().__iter__()


def round_robin(n: int) -> accelerate_stateful.RoundRobinDataset:
    return accelerate_stateful.RoundRobinDataset(MainProcessSource(n), transform=decode)


HF_STREAMS = {"hf-stream-1": (1, False), "hf-stream-2": (2, False), "hf-stream-4": (4, False),
              "hf-stream-6-shuffled": (6, True), "hf-stream-15-shuffled": (15, True)}  # name: (shards, shuffled)
DATASETS: dict[str, Callable[[int], Any]] = {
    "map": Ids, "stream": CountingStream, "sized-stream": SizedCountingStream, "opaque": OpaqueStream,
    "sized-opaque": SizedOpaqueStream, "hf-table": hf_table, "round-robin": round_robin,
    **{name: hf_stream(*spec) for name, spec in HF_STREAMS.items()},
}
MAP_STYLE = ("map", "hf-table")


def is_iterable(cfg: dict) -> bool:
    return cfg["data"] not in MAP_STYLE


def is_sized(cfg: dict) -> bool:
    return cfg["data"] in MAP_STYLE or cfg["data"].startswith("sized-")


def reads_whole_shards(cfg: dict, world: int) -> bool:
    """Whether each rank reads whole shards of a ``datasets`` stream instead of slicing every global batch:
    Accelerate's choice, on several processes, with at least as many shards as processes and no split_batches."""
    shards = HF_STREAMS[cfg["data"]][0] if cfg["data"] in HF_STREAMS else 0
    return not dispatches(cfg) and world > 1 and not cfg["split"] and shards >= world


def dispatches(cfg: dict) -> bool:
    """Whether the dispatcher serves this scenario (Accelerate's choice when ``dispatch_batches`` is None)."""
    return is_iterable(cfg) if cfg["dispatch"] is None else cfg["dispatch"]


def reads_here(cfg: dict) -> bool:
    """Whether this rank reads the data (the dispatcher reads on the main process only)."""
    state = PartialState()
    return not dispatches(cfg) or state.is_main_process or state.num_processes == 1


def make_dataloader(cfg: dict) -> DataLoader:
    kwargs: dict[str, Any] = {}
    if cfg["shuffle"] == "generator":
        kwargs = {"shuffle": True, "generator": torch.Generator().manual_seed(1234)}
    elif cfg["shuffle"] == "drawn":
        kwargs = {"shuffle": True}
    if cfg["persistent"]:
        kwargs["persistent_workers"] = True
    if cfg.get("bsampler"):
        generator = kwargs.pop("generator", None)
        order = RandomSampler(range(cfg["n"]), generator=generator) if kwargs.pop("shuffle", False) else \
            SequentialSampler(range(cfg["n"]))
        return DataLoader(DATASETS[cfg["data"]](cfg["n"]), num_workers=cfg["workers"],
                          batch_sampler=BatchSampler(order, cfg["bs"], cfg["drop_last"]), **kwargs)
    return DataLoader(DATASETS[cfg["data"]](cfg["n"]), batch_size=cfg["bs"], drop_last=cfg["drop_last"],
                      num_workers=cfg["workers"], **kwargs)


def batch_ids(batch: Any) -> torch.Tensor:
    """The sample ids of a batch: the batch itself, or its ``"id"`` entry (``datasets`` and transforms give dicts)."""
    return (batch["id"] if isinstance(batch, Mapping) else batch).cpu()


def dataloader_config(cfg: dict, stateful: bool) -> DataLoaderConfiguration:
    return DataLoaderConfiguration(use_stateful_dataloader=stateful, split_batches=cfg["split"],
                                   even_batches=cfg["even"], dispatch_batches=cfg["dispatch"])


@contextlib.contextmanager
def captured_warnings(name: str = "accelerate_stateful"):
    """The warnings the package logs meanwhile."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


class Findings:
    """The differences a scenario found; recorded, not raised, so every rank runs the same collectives."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self.compared = 0  # runs compared with the uninterrupted one
        self.batch_counts: list[int] = []  # per rank, per epoch
        self.resumed_kinds: list[str] = []  # the kinds of save point resumed from (``labelled_points``)

    def add(self, difference: str) -> None:
        self.items.append(difference)

    def same_steps(self, reference: list[dict], seen: list[dict], what: str) -> None:
        self.compared += 1
        for i, (want, got) in enumerate(zip(reference, seen)):
            if want != got:
                return self.add(f"{what}: batch {i} differs: expected {want}, got {got}")
        if len(seen) != len(reference):
            unmatched = seen[len(reference)] if len(seen) > len(reference) else reference[len(seen)]
            self.add(f"{what}: {len(seen)} batches, the uninterrupted run has {len(reference)} "
                     f"(first unmatched: {unmatched})")


# --------------------------------------------------------------------------- one process lifetime
class Run:
    """One simulated process: a fresh Accelerator, DataLoader, model and optimizer, prepared.

    ``per_epoch`` is the smallest per-rank batch count of each epoch (the first one shortened by a skip):
    every rank reaches that batch together, so it is where collectives and in-loop saves are safe.
    """

    restarts = 0

    def __init__(self, cfg: dict, per_epoch: list[int], resume_from: Optional[Path] = None,
                 project_dir: Optional[Path] = None, fresh: Optional[bool] = None) -> None:
        Run.restarts += 1
        fresh = resume_from is None if fresh is None else fresh
        GradientState._reset_state()  # a new process starts with a fresh GradientState
        rank = PartialState().process_index
        # Same seed for every fresh start (as after `set_seed`), another one for every restart; ranks differ.
        torch.manual_seed((FRESH_SEED if fresh else 1000 * Run.restarts) + rank)
        project = None
        if project_dir is not None:
            project = ProjectConfiguration(project_dir=str(project_dir), automatic_checkpoint_naming=True,
                                           total_limit=2)
        self.cfg, self.per_epoch = cfg, per_epoch
        self.acc = accelerate_stateful.Accelerator(
            dataloader_config=dataloader_config(cfg, stateful=True),
            gradient_accumulation_steps=cfg["ga"],
            project_config=project,
            cpu=True,
        )
        model = torch.nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        self.model, self.optimizer, self.dl = self.acc.prepare(model, optimizer, make_dataloader(cfg))
        self.loader = self.dl
        self.warnings: list[str] = []
        if resume_from is not None:
            with captured_warnings() as records:
                self.acc.load_state(resume_from)
            self.warnings = [record.getMessage() for record in records]
        elif fresh and cfg["skip"]:
            self.loader = self.acc.skip_first_batches(self.dl, cfg["skip"])

    @property
    def replayed_samples(self) -> int:
        """Samples the loader reads again to resume (an opaque stream is fast-forwarded); 0 for map-style data."""
        reader = self.dl.reader if isinstance(self.dl, DispatchDataLoader) else self.dl
        return getattr(reader, "replayed_samples", 0)

    def train_step(self, ids: torch.Tensor) -> None:
        with self.acc.accumulate(self.model):
            loss = self.model(ids.float().unsqueeze(1) / 100).pow(2).mean()
            self.acc.backward(loss)
            self.optimizer.step()
            self.optimizer.zero_grad()

    def drive(self, seen: list[dict], saves: dict, auto: bool = False,
              stop_after_save: bool = False) -> tuple[list[dict], Optional[SavePoint]]:
        """The training loop, to the end (or to the first save with ``stop_after_save``), saving at ``saves``.

        ``seen`` are the batches earlier runs took. Returns this run's batches and where it stopped, if early.
        """
        acc, steps = self.acc, []

        def save_at(point: SavePoint) -> bool:
            if point in saves:
                acc.save_state() if auto else acc.save_state(saves[point])
                return stop_after_save
            return False

        if save_at(("start",)):
            return steps, ("start",)
        for epoch in range(self.dl.epoch, EPOCHS):
            k = sum(1 for step in seen + steps if step["epoch"] == epoch)
            with self.join():
                for batch in self.loader:
                    k += 1
                    steps.append(self.record(epoch, k, batch))
                    if save_at(("in", epoch, k)):
                        return steps, ("in", epoch, k)
            self.loader = self.dl  # a skip applies to the epoch it was made in only
            if save_at(("after", epoch)):
                return steps, ("after", epoch)
        if save_at(("done",)):
            return steps, ("done",)
        return steps, None

    def join(self) -> contextlib.AbstractContextManager:
        """DDP's Join, for ranks with different batch counts (even_batches=False).

        ``accelerator.join_uneven_inputs`` does this on GPUs only; on CPU it warns and does nothing.
        """
        if self.cfg["even"] or self.acc.distributed_type == DistributedType.NO:
            return contextlib.nullcontext()
        return Join([self.model])

    def record(self, epoch: int, k: int, batch: Any) -> dict:
        acc, ids = self.acc, batch_ids(batch)
        self.train_step(ids)
        step = {
            "epoch": epoch,
            "ids": ids.tolist(),
            "sync": bool(acc.sync_gradients),
            "end": bool(acc.gradient_state.end_of_dataloader),
            "yielded": self.dl.batches_yielded,
        }
        if isinstance(batch, Mapping) and "worker" in batch:  # a round-robin transform says where it ran
            step["in_worker"] = bool((batch["worker"] >= 0).all())
        if self.cfg["equal_counts"] and k == self.per_epoch[epoch]:
            step["gathered"] = gather_last(acc, self.cfg, ids)
        return step


def gather_last(acc: accelerate.Accelerator, cfg: dict, ids: torch.Tensor) -> list[int]:
    """``gather_for_metrics`` of an epoch's last batch, which drops the padding when the loader knows it."""
    if cfg["drop_last"] or cfg["even"]:  # equal batch sizes: the tensor path
        return acc.gather_for_metrics(ids).tolist()
    return list(acc.gather_for_metrics(ids.tolist()))  # the last batches may differ in size: the object path


# --------------------------------------------------------------------------- save points
def labelled_points(per_epoch: list[int]) -> dict[SavePoint, list[str]]:
    """Before the first batch, after the first, mid-epoch, before and after the last (in and after the
    loop), in later epochs, and after the epoch loop; each with the kinds of point it is (one point may be
    several where an epoch is short)."""
    first, later = per_epoch[0], per_epoch[1]
    kinds = [(("start",), "start"), (("in", 0, 1), "first-batch"), (("in", 0, max(first // 2, 1)), "mid-epoch"),
             (("in", 0, max(first - 1, 1)), "before-last-batch"), (("in", 0, first), "last-batch"),
             (("after", 0), "after-epoch"), (("in", 1, 1), "next-epoch-first-batch"),
             (("in", 1, max(later // 2, 1)), "next-epoch-mid"), (("in", EPOCHS - 1, later), "last-epoch-last-batch"),
             (("after", EPOCHS - 1), "after-last-epoch"), (("done",), "after-the-loop")]
    points: dict[SavePoint, list[str]] = {}
    for point, kind in kinds:
        points.setdefault(point, []).append(kind)
    return points


POINT_KINDS = ["start", "first-batch", "mid-epoch", "before-last-batch", "last-batch", "after-epoch",
               "next-epoch-first-batch", "next-epoch-mid", "last-epoch-last-batch", "after-last-epoch",
               "after-the-loop"]  # as labelled_points names them, in its order


def save_points(per_epoch: list[int]) -> list[SavePoint]:
    return list(labelled_points(per_epoch))


# Which save points a scenario resumes from. The saving run saves at every point (and must still equal the
# uninterrupted run); ``make test`` then resumes each kind of point from one scenario of each group of a launch
# (those with workers, those without; three or more each): kind i from the scenario at place
# (i + rotation) % len(group), and a group of three from one kind in RESUME_SHARE per scenario. Each scenario
# runs one of the two chains of resumes, in turn, so a group runs both. So each group resumes from every kind of
# point between its scenarios, and through both chains (``test_multiprocess`` checks it).
# A resume is a run to the end: with workers each of its epochs forks them, which is most of a launch's time.
# RESUME_SAMPLE=full (``make test-full``, the soak, a launch by hand) resumes every point and runs both chains in
# every scenario; another word draws another rotation.
RESUME_SHARE = 3
RESUME_SAMPLE = os.environ.get("RESUME_SAMPLE", "full")


def _rotation(sample: str) -> int:
    return int(hashlib.sha1(sample.encode()).hexdigest(), 16)


def resumed_points(per_epoch: list[int], place: int, group: int, sample: str = RESUME_SAMPLE) -> list[SavePoint]:
    """The save points the ``place``-th scenario of its group (``group`` scenarios) resumes from, in order."""
    labels = labelled_points(per_epoch)
    if sample == "full":
        return list(labels)
    starts = [chain[0] for chain in scenario_chains(per_epoch, place, sample)]
    share = max(RESUME_SHARE, group)
    offset = (place + _rotation(sample)) % share
    # by kind, not by place in the list: a short epoch makes two kinds one point, which shifts the places
    kept = {kind for i, kind in enumerate(POINT_KINDS) if (i + offset) % share == 0}
    return [point for point, kinds in labels.items() if kept.intersection(kinds) or point in starts]


def scenario_chains(per_epoch: list[int], place: int, sample: str = RESUME_SAMPLE) -> list[list[SavePoint]]:
    """The chains of resumes the ``place``-th scenario of its group runs: one of them, in turn (every one in
    the full sample)."""
    every = chains(per_epoch)
    return every if sample == "full" else [every[(place + _rotation(sample)) % len(every)]]


def chains(per_epoch: list[int]) -> list[list[SavePoint]]:
    """Successive resumes: each checkpoint after the first is written by the run resumed from the previous."""
    return [
        # save mid-epoch; resume and save again at once (a restored, unstarted loader); resume, save in epoch 1
        [("in", 0, max(per_epoch[0] // 2, 1)), ("start",), ("in", 1, 1)],
        [("after", 0), ("in", 2, max(per_epoch[2] - 1, 1))],
    ]


def batches_before(chain: list[SavePoint], own: list[int]) -> int:
    """How many batches of this rank's uninterrupted run precede the last point of ``chain``.

    ``own`` is this rank's batch count per epoch (ranks differ without even_batches).
    """
    for point in reversed(chain):
        if point[0] == "in":
            return sum(own[: point[1]]) + point[2]
        if point[0] == "after":
            return sum(own[: point[1] + 1])
        if point[0] == "done":
            return sum(own)
    return 0  # only ("start",) points: nothing taken yet


# --------------------------------------------------------------------------- checks
def epoch_order(cfg: dict, epoch: int) -> Optional[list[int]]:
    """The order in which ``epoch`` reads the samples, where it is known: unshuffled map-style data, a
    round-robin source (delivered in the order it is read, whatever the workers), or a stream read without
    workers: ``streams._share`` rotates it by the epoch, a ``datasets`` stream is in ``datasets``' own order
    for that epoch unless the ranks read whole shards (their shares interleave step by step)."""
    n = cfg["n"]
    if not is_iterable(cfg):
        return list(range(n)) if cfg["shuffle"] == "off" else None
    if cfg["data"] == "round-robin":
        return OpenOnce.order(n, epoch)
    if cfg["workers"]:
        return None  # batches alternate between the workers' shares
    if cfg["data"] in HF_STREAMS:
        if reads_whole_shards(cfg, PartialState().num_processes):
            return None
        stream = DATASETS[cfg["data"]](n)
        stream.set_epoch(epoch)
        return [example["id"] for example in stream]
    return list(range(epoch % n, n)) + list(range(epoch % n))


def check_reference(cfg: dict, reference: list[dict], found: Findings) -> None:
    """The uninterrupted run itself is right.

    Across ranks each epoch delivers every sample once (minus ``drop_last``), counting the last step as
    ``gather_for_metrics`` returns it (padding dropped); on each rank ``end_of_dataloader`` is set on the
    epoch's last batch only, ``sync_gradients`` every ``ga`` batches and there, and ``batches_yielded``
    counts the epoch's batches (skipped ones included).

    Two iterable cases are weaker, as they are with Accelerate's own loader: ranks slicing a stream they
    each read pad the last global batch of *each worker*, and ``gather_for_metrics`` can drop the padding
    only given the dataset's ``len()`` and no workers, so there every sample must be delivered, padding
    aside; and with workers each worker's short last batch is dropped by ``drop_last`` or, by the
    dispatcher, cut to a multiple of the number of processes, so there the delivered samples must be
    distinct. Ranks reading whole shards of a ``datasets`` stream pad nothing, and a round-robin source is
    read in one place, batched before the workers see it: both must deliver every sample once.

    A round-robin transform must have run in the workers when there are some, and in the main process otherwise.
    """
    world = PartialState().num_processes
    logs = gather_object([reference])
    n, total = cfg["n"], cfg["bs"] if cfg["split"] else cfg["bs"] * world
    expected = (n // total) * total if cfg["drop_last"] else n
    padding_kept = (is_iterable(cfg) and not dispatches(cfg) and world > 1 and not cfg["drop_last"]
                    and not reads_whole_shards(cfg, world) and (cfg["workers"] > 0 or not is_sized(cfg)))
    # Each worker's stream ends in a short batch: drop_last drops it; the dispatcher slices it in equal
    # parts like any other step, and the remainder of the division is lost (Accelerate's dispatcher too).
    cut_per_worker = (is_iterable(cfg) and cfg["data"] != "round-robin" and cfg["workers"] > 0
                      and (cfg["drop_last"] or dispatches(cfg)))
    if cfg["data"] == "round-robin":
        wanted = "in the workers" if cfg["workers"] else "in the main process"
        if {s["in_worker"] for s in reference} != {cfg["workers"] > 0}:
            found.add(f"reference: with num_workers={cfg['workers']} the round-robin transform must run {wanted} "
                      f"for every batch; in_worker per batch was {[s['in_worker'] for s in reference]}")
    for epoch in range(1 if cfg["skip"] else 0, EPOCHS):
        per_rank = [[s for s in log if s["epoch"] == epoch] for log in logs]
        delivered: list[int] = []
        for k in range(max(len(steps) for steps in per_rank)):
            head = next(steps[k] for steps in per_rank if k < len(steps))
            if "gathered" in head:  # the same gathered list on every rank
                delivered += head["gathered"]
            else:
                delivered += [i for steps in per_rank if k < len(steps) for i in steps[k]["ids"]]
        order = epoch_order(cfg, epoch)
        if cut_per_worker:
            if len(set(delivered)) != len(delivered) or not set(delivered) <= set(range(n)):
                found.add(f"reference epoch {epoch}: the ranks together delivered {delivered}, expected distinct "
                          f"samples of 0..{n - 1}")
        elif padding_kept:
            if set(delivered) != set(range(n)) or (order is not None and delivered[:n] != order):
                found.add(f"reference epoch {epoch}: the ranks together delivered {delivered}, expected every "
                          f"sample of 0..{n - 1} (in the order {order}), then padding")
        elif len(set(delivered)) != len(delivered) or len(delivered) != expected:
            found.add(f"reference epoch {epoch}: the ranks together delivered {len(delivered)} samples "
                      f"{delivered} (gather_for_metrics on the last batch), expected {expected} distinct ones")
        elif order is not None and delivered != order[:expected]:
            found.add(f"reference epoch {epoch}: ranks together delivered {delivered}, expected {order[:expected]}")
    check_dispatched_padding(cfg, logs, found)
    for epoch in range(EPOCHS):
        steps = [s for s in reference if s["epoch"] == epoch]
        skipped = cfg["skip"] if epoch == 0 else 0
        last = len(steps)
        want = [(k == last, k % cfg["ga"] == 0 or k == last, skipped + k) for k in range(1, last + 1)]
        got = [(s["end"], s["sync"], s["yielded"]) for s in steps]
        if got != want:
            found.add(f"reference epoch {epoch} on this rank: (end_of_dataloader, sync_gradients, batches_yielded) "
                      f"per batch were {got}, expected {want}")


def check_dispatched_padding(cfg: dict, logs: list[list[dict]], found: Findings) -> None:
    """The dispatcher completes each epoch's last step with the epoch's first samples (``even_batches``), also in
    an epoch the loader entered by ``skip_first_batches``, where it never read them: checked where the order is
    known (unshuffled map-style data)."""
    order = epoch_order(cfg, 0)
    if not dispatches(cfg) or is_iterable(cfg) or cfg["drop_last"] or order is None:
        return
    world = len(logs)
    total = cfg["bs"] if cfg["split"] else cfg["bs"] * world
    real = cfg["n"] % total
    if real == 0 or real % world == 0:
        return  # the last step divides evenly: nothing is added
    padded = order[cfg["n"] - real:] + order[:-(-real // world) * world - real]
    for epoch in range(EPOCHS):
        last = [[s for s in log if s["epoch"] == epoch][-1]["ids"] for log in logs]
        if [i for ids in last for i in ids] != padded:
            found.add(f"reference epoch {epoch}: the dispatcher's last step across ranks was {last}, expected "
                      f"{padded}: its last samples completed with the epoch's first")


def check_accelerate_parity(cfg: dict, reference: list[dict], ours_len: Optional[int], found: Findings) -> None:
    """Without shuffling, each rank gets exactly the batches of Accelerate's own loader (drop-in equivalence).

    Same ``DataLoaderConfiguration`` with ``use_stateful_dataloader=False``, same dataset: per batch the ids
    and ``end_of_dataloader``, ``len()``, and, where Accelerate knows the padding of the last batch (its
    dispatcher, and map-style shards), ``gather_for_metrics`` of the last batch. A skip goes through
    Accelerate's ``skip_first_batches``. Accelerate's loader leaves a stateful stream where the last epoch
    ended (read in this process, or in a persistent worker), so its second epoch would be empty, and a
    persistent worker never sees ``set_epoch``: for those streams only the first epoch is compared.
    """
    GradientState._reset_state()
    acc = accelerate.Accelerator(dataloader_config=dataloader_config(cfg, stateful=False), cpu=True)
    dl = acc.prepare(make_dataloader(cfg))
    theirs_len = _length(dl)
    if theirs_len != ours_len:
        found.add(f"len() is {ours_len}, Accelerate's own loader has {theirs_len}")
    stateful_stream = cfg["data"] in ("stream", "sized-stream")
    epochs = 1 if stateful_stream and not cfg["workers"] else EPOCHS
    if is_iterable(cfg) and cfg["persistent"]:
        epochs = 1  # a persistent worker's copy of the stream keeps its position and misses set_epoch()
    gathers = dispatches(cfg) or not is_iterable(cfg)
    theirs = []
    for epoch in range(epochs):
        loader = acc.skip_first_batches(dl, cfg["skip"]) if epoch == 0 and cfg["skip"] else dl
        for batch in loader:
            ids = batch_ids(batch)
            step = {"epoch": epoch, "ids": ids.tolist(), "end": bool(acc.gradient_state.end_of_dataloader)}
            if gathers and cfg["equal_counts"] and step["end"]:
                step["gathered"] = gather_last(acc, cfg, ids)
            theirs.append(step)
    keys = ("epoch", "ids", "end", "gathered") if gathers else ("epoch", "ids", "end")
    ours = [{k: s[k] for k in keys if k in s} for s in reference if s["epoch"] < epochs]
    if theirs != ours:
        first = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
        found.add(f"epochs 0..{epochs - 1} differ from Accelerate's own loader from batch {first} on "
                  f"(of {len(theirs)} there, {len(ours)} here): Accelerate {theirs[first:first + 3]}, "
                  f"ours {ours[first:first + 3]}; all of Accelerate's: {theirs}; ours: {ours}")


def _length(dl: Any) -> Optional[int]:
    try:
        return len(dl)
    except TypeError:  # a stream without len()
        return None


def check_replay(cfg: dict, run: Run, chain: list[SavePoint], own: list[int], found: Findings) -> None:
    """Resuming an opaque stream mid-epoch fast-forwards it, counted and warned about; nothing else replays.

    Only the ranks that read count (the dispatcher reads on the main process). A save inside the loop after
    an epoch's last batch may replay or not: either continues exactly.
    """
    if not is_iterable(cfg):
        return
    point = next((p for p in reversed(chain) if p != ("start",)), ("start",))
    if point[0] == "in" and point[2] == own[point[1]]:
        return
    got = run.replayed_samples
    name = DATASETS[cfg["data"]].__name__
    warned = [w for w in run.warnings if name in w]
    if "opaque" in cfg["data"] and point[0] == "in" and reads_here(cfg):
        if got <= 0 or len(warned) != 1:
            found.add(f"resumed from {chain}: replayed_samples={got} and {len(warned)} warnings naming {name} "
                      f"({run.warnings}); expected samples replayed and one warning")
    elif got != 0 or warned:
        found.add(f"resumed from {chain}: replayed_samples={got}, warnings {run.warnings}; expected no replay")


def check_auto_restarts(cfg: dict, reference: list[dict], per_epoch: list[int], project: Path,
                        found: Findings) -> None:
    """Kill and start the same command again: ``resume()`` picks the newest complete checkpoint every time."""
    points = chains(per_epoch)[0] + [("done",)]
    seen: list[dict] = []
    expected: Optional[Path] = None
    for number, point in enumerate(points + [None]):
        run = Run(cfg, per_epoch, project_dir=project, fresh=number == 0)
        loaded = run.acc.resume()
        if loaded != expected:
            found.add(f"auto restart {number}: resume() returned {loaded}, expected {expected}")
        steps, stopped = run.drive(seen, {point: None} if point else {}, auto=True, stop_after_save=True)
        seen += steps
        if stopped != point:
            found.add(f"auto restart {number}: stopped at {stopped}, expected the save point {point}")
        expected = project / "checkpoints" / f"checkpoint_{number}"
    found.same_steps(reference, seen, f"restarts via resume() after saving at {points}")
    kept = [p.name for p in _files.complete_checkpoints(project / "checkpoints")]
    want = [f"checkpoint_{len(points) - 1}", f"checkpoint_{len(points) - 2}"]
    if kept != want:
        found.add(f"auto restarts: total_limit=2 kept {kept}, expected {want}")


# --------------------------------------------------------------------------- one scenario
def count_batches(cfg: dict) -> int:
    """This rank's batches in an epoch of an iterable dataset, by running one (with workers, or without a
    ``len()``, nothing else tells)."""
    return sum(1 for _ in Run(cfg, per_epoch=[]).dl)


def run_scenario(cfg: dict, root: Path, found: Findings) -> None:
    cfg = dict(cfg)
    counted = count_batches(cfg) if is_iterable(cfg) else None
    first = Run(cfg, per_epoch=[])  # set below, once every rank's batch count is known
    ours_len = _length(first.dl)
    lengths = gather_object([ours_len if counted is None else counted])
    cfg["equal_counts"] = len(set(lengths)) == 1
    found.batch_counts = lengths
    per_epoch = [min(lengths) - cfg["skip"]] + [min(lengths)] * (EPOCHS - 1)
    if per_epoch[0] < 2:
        raise ValueError(f"scenario too small: per-rank batch counts {lengths}; use a larger n")
    if reads_whole_shards(cfg, PartialState().num_processes) and cfg["drop_last"]:
        raise ValueError("check_reference cannot count what drop_last drops on ranks reading whole shards")
    if not cfg["equal_counts"] and cfg["ga"] > 1:
        raise ValueError(f"per-rank batch counts {lengths} differ: DDP deadlocks with gradient accumulation")
    first.per_epoch = per_epoch

    reference, _ = first.drive([], {})
    del first
    own = [sum(1 for s in reference if s["epoch"] == epoch) for epoch in range(EPOCHS)]
    check_reference(cfg, reference, found)
    # Accelerate has no round-robin loader: its own would copy a RoundRobinDataset into every rank and worker,
    # which is what the source refuses, so there is no behaviour to be a drop-in for.
    # Accelerate's own dispatcher counts a skip in the batches of the loader it wraps, world_size of them to a
    # step without split_batches; ours in its own steps, as len() counts them (check_dispatched_padding instead).
    skips_differ = cfg["skip"] and dispatches(cfg) and not cfg["split"]
    if cfg["shuffle"] == "off" and cfg["data"] != "round-robin" and not skips_differ:
        check_accelerate_parity(cfg, reference, ours_len, found)

    points = save_points(per_epoch)
    folders = {point: root / f"save{i}" for i, point in enumerate(points)}
    saver, _ = Run(cfg, per_epoch).drive([], folders)
    found.same_steps(reference, saver, "run checkpointing at every save point")

    all_chains = scenario_chains(per_epoch, cfg["place"])
    resumed = resumed_points(per_epoch, cfg["place"], cfg["group"])
    labels = labelled_points(per_epoch)
    found.resumed_kinds = sorted({kind for point in resumed for kind in labels[point]})
    for point in resumed:
        # A resume that starts a chain writes the chain's next checkpoint along the way.
        nxt = {c[1]: root / f"chain{j}-1" for j, c in enumerate(all_chains) if c[0] == point}
        before = reference[: batches_before([point], own)]
        run = Run(cfg, per_epoch, resume_from=folders[point])
        check_replay(cfg, run, [point], own, found)
        steps, _ = run.drive(before, nxt)
        found.same_steps(reference, before + steps, f"resumed from {point}")
    for j, chain in enumerate(all_chains):
        for link in range(1, len(chain)):
            nxt = {chain[link + 1]: root / f"chain{j}-{link + 1}"} if link + 1 < len(chain) else {}
            before = reference[: batches_before(chain[: link + 1], own)]
            run = Run(cfg, per_epoch, resume_from=root / f"chain{j}-{link}")
            check_replay(cfg, run, chain[: link + 1], own, found)
            steps, _ = run.drive(before, nxt)
            found.same_steps(reference, before + steps, f"resume chain {chain[: link + 1]}")
    if cfg["auto"]:
        check_auto_restarts(cfg, reference, per_epoch, root / "auto", found)


# The launches that also run the everyday loops of ``mp_loops.py`` (2 and 3 processes; the loader prepared after
# load_state on 2 only: its handover makes the same collectives on 3).
LOOP_SETS = {"world2": LOOP_IDS, "world3": [case for case in LOOP_IDS if case != "loops-late-eval"]}


def expected_ids(set_name: str) -> list[str]:
    """The ids of what a launch of ``set_name`` runs, in order."""
    return [s["id"] for s in ALL_SETS[set_name]] + LOOP_SETS.get(set_name, [])


def main(out_dir: Path, set_name: str, only: Optional[str] = None) -> None:
    state = PartialState(cpu=True, timeout=COLLECTIVE_TIMEOUT)
    torch.set_num_threads(1)
    wanted = expected_ids(set_name) if only is None else only.split(",")
    unknown = set(wanted) - set(expected_ids(set_name))
    if unknown:
        raise ValueError(f"{set_name} has no scenario {sorted(unknown)}")
    scenarios = [cfg for cfg in ALL_SETS[set_name] if cfg["id"] in wanted]
    scenarios += [{"id": case} for case in LOOP_IDS if case in wanted]
    if state.is_main_process:
        print(f"{set_name}: {len(scenarios)} scenarios on {state.num_processes} processes "
              f"({state.distributed_type})", flush=True)
    results = []
    for cfg in scenarios:
        # A pass the last scenario dropped while a caught exception's traceback held it ends when the garbage
        # collector runs, at a different moment on each rank, and its end unregisters its loader from Accelerate's
        # GradientState; collected here, it ends at the same point of every rank's run.
        mp_harness_rank.set_aside()
        if dist.is_initialized():
            dist.barrier()
        started = time.perf_counter()
        found = Findings()
        try:
            if cfg["id"] in LOOP_IDS:
                found.compared = run_loop_case(cfg["id"], out_dir / "checkpoints" / cfg["id"], found.add)
            else:
                # the rotation runs through the scenarios with workers and those without apart: both resume
                # from every kind of point in each launch
                group = [c for c in ALL_SETS[set_name] if (c["workers"] > 0) == (cfg["workers"] > 0)]
                run_scenario({**cfg, "place": group.index(cfg), "group": len(group)},
                             out_dir / "checkpoints" / cfg["id"], found)
        except Exception as exc:  # recorded here, then the launch ends on every rank (mp_harness_rank.run)
            found.add(f"raised {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            results.append({"id": cfg["id"], "passed": False, "difference": found.items[0], "raised": True})
            (out_dir / f"rank{state.process_index}.json").write_text(json.dumps(results, indent=1))
            raise
        # Every rank must have finished the same scenario; anything else is a desync.
        finished = gather_object([(cfg["id"], not found.items)])
        if {sid for sid, _ in finished} != {cfg["id"]}:
            raise RuntimeError(f"collective desync: ranks finished scenarios {finished}")
        if state.is_main_process and all(ok for _, ok in finished):
            shutil.rmtree(out_dir / "checkpoints" / cfg["id"])  # keep the checkpoints of failures only
        results.append({
            "id": cfg["id"],
            "passed": not found.items,
            "difference": found.items[0] if found.items else None,
            "differences": len(found.items),
            "other_differences": [item[:2000] for item in found.items[1:6]],
            "seconds": round(time.perf_counter() - started, 2),
            "resumes_compared": found.compared,
            "batches_per_rank": found.batch_counts,
            "resumed_kinds": found.resumed_kinds,
            "workers": cfg.get("workers", 0),
        })
        path = out_dir / f"rank{state.process_index}.json"
        path.write_text(json.dumps(results, indent=1))
        if state.is_main_process:
            print(f"  {cfg['id']}: {'ok' if not found.items else 'FAILED'}, {found.compared} runs compared, "
                  f"batches per rank {found.batch_counts} ({results[-1]['seconds']} s)", flush=True)
    state.wait_for_everyone()


if __name__ == "__main__":
    mp_harness_rank.run(main, Path(sys.argv[1]), sys.argv[2], *sys.argv[3:])
