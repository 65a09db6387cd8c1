"""The streaming-format loaders: litdata and mosaicml-streaming, each a ``StreamingDataset`` + its
``StreamingDataLoader``. Their 1 -> 2 processes cell is not measured yet: in our 2-process launch litdata's
resume hung (45 s without output) and mosaicml-streaming's process group failed to connect, and neither is
diagnosed; the cell says "not yet measured" rather than blame the loader for what may be our launch.

litdata (its README, "Pause & resume data streaming"): the samples are written once as chunks
(``BinaryWriter``, what ``litdata.optimize`` writes), read by ``StreamingDataset(dir, shuffle=True, seed=0)``
through a ``StreamingDataLoader``, whose ``state_dict()`` is saved with the epoch and given back to
``load_state_dict()``; a mixture is ``CombinedStreamingDataset`` with weights.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from scenarios import EPOCHS, Scenario, seed_everything, source_ids

_WRITTEN: dict = {}  # the chunks of each list of ids, written once per process


def _chunks(ids: list) -> str:
    key = tuple(ids)
    if key not in _WRITTEN:
        from litdata.streaming.writer import BinaryWriter

        folder = tempfile.mkdtemp(prefix="conformance-litdata-")
        writer = BinaryWriter(folder, chunk_size=6)
        for n, i in enumerate(ids):
            writer[n] = {"id": i}
        writer.done()
        writer.merge()
        _WRITTEN[key] = folder
    return _WRITTEN[key]


def litdata_segment(scenario: Scenario, folder: Path, segment: int, stop: Optional[int],
                    on_first=None, cost_s: float = 0.0) -> list:
    from litdata import CombinedStreamingDataset, StreamingDataLoader, StreamingDataset

    seed_everything()
    parts = [StreamingDataset(_chunks(ids), shuffle=True, seed=0) for ids in source_ids(scenario)]
    data = parts[0] if len(parts) == 1 else CombinedStreamingDataset(parts, seed=0, weights=[0.5, 0.5], iterate_over_all=False)
    dl = StreamingDataLoader(data, batch_size=scenario.batch(segment), num_workers=scenario.workers)
    return _run_segment(dl, folder, stop, on_first, cost_s)


def _run_segment(dl, folder: Path, stop: Optional[int], on_first, cost_s: float) -> list:
    """Both libraries' documented resume: the loader's ``state_dict()`` saved with the epoch after ``stop``
    batches, given back to ``load_state_dict()`` by the next segment; the ids trained, with their epoch."""
    path, start_epoch = folder / "loader.pt", 0
    if path.exists():
        saved = torch.load(path, weights_only=False)
        dl.load_state_dict(saved["loader"])
        start_epoch = saved["epoch"]
    trained, done = [], 0
    for epoch in range(start_epoch, EPOCHS):
        for batch in dl:
            if cost_s:
                time.sleep(cost_s * len(batch["id"]))  # the reads' cost, paid where the library reads
            if on_first is not None:
                return on_first()
            trained += [(epoch, int(i)) for i in batch["id"]]
            done += 1
            if done == stop:
                torch.save({"loader": dl.state_dict(), "epoch": epoch}, path)
                return trained
    return trained


_MDS: dict = {}


def _mds(ids: list) -> str:
    key = tuple(ids)
    if key not in _MDS:
        from streaming import MDSWriter

        folder = tempfile.mkdtemp(prefix="conformance-mds-")
        with MDSWriter(out=folder, columns={"id": "int"}, size_limit=256) as writer:
            for i in ids:
                writer.write({"id": i})
        _MDS[key] = folder
    return _MDS[key]


def mosaic_segment(scenario: Scenario, folder: Path, segment: int, stop: Optional[int],
                   on_first=None, cost_s: float = 0.0) -> list:
    """mosaicml-streaming (its "Resumption" guide): ``StreamingDataLoader.state_dict()`` saved, given back to
    ``load_state_dict()``; the dataset's ``batch_size`` is the loader's; a mixture is ``Stream``s with
    proportions."""
    from streaming import Stream, StreamingDataLoader, StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()  # a previous segment of this process stands for a killed process
    seed_everything()
    batch, sources = scenario.batch(segment), source_ids(scenario)
    common = {"shuffle": True, "shuffle_seed": 0, "batch_size": batch}
    if len(sources) == 1:
        data = StreamingDataset(local=_mds(sources[0]), **common)
    else:
        data = StreamingDataset(streams=[Stream(local=_mds(s), proportion=0.5) for s in sources], **common)
    dl = StreamingDataLoader(data, batch_size=batch, num_workers=scenario.workers)
    return _run_segment(dl, folder, stop, on_first, cost_s)
