"""The streaming-format loaders: litdata and mosaicml-streaming, each a ``StreamingDataset`` + its
``StreamingDataLoader``.

litdata (its README, "Pause & resume data streaming" and "Streams on multi-GPU, multi-node"): the samples are
written once as chunks (``BinaryWriter``, what ``litdata.optimize`` writes), read by
``StreamingDataset(dir, shuffle=True, drop_last=True, seed=0)`` (the README's training dataset: "don't forget to
enable shuffle and drop_last") through a ``StreamingDataLoader``, whose ``state_dict()`` is saved with the epoch
and given back to ``load_state_dict()``; a mixture is ``CombinedStreamingDataset`` with weights. On several
processes the script starts a process group, as a PyTorch DDP script does: litdata takes its rank from it.
Left at its default, ``drop_last`` is False on 1 process and True on several, and the 1 -> 2 resume is refused
("The provided `drop_last` state doesn't match the current one").

mosaicml-streaming: see ``mosaic_segment``; on several processes its script starts the process group too.

The 1 -> 2 processes cells once read "not yet measured" (litdata's launch hung, mosaicml-streaming's process
group "failed to connect"). Both were this file's setup, not the launch: each rank wrote its own copy of the
data into a private temporary folder. litdata's ``BinaryWriter.merge()``, seeing ``WORLD_SIZE=2``, waited
forever for the other rank's index in that private folder; mosaicml-streaming refused ranks whose ``local``
differ ("shared memory registered does not match local leader") and rank 0 then lost its peer. Every process of
a run now reads one copy, written once per machine at a path named by the ids (``_written``). And left to
start torch.distributed itself, mosaicml-streaming starts and ends a process group in
``clean_stale_shared_memory()`` and again in ``StreamingDataset()``: under exec-started ranks (the forked
launch happened to pass) the second one never connected ("Gloo connectFullMesh failed ... Connection
refused"). A PyTorch DDP script starts its group first, and then mosaicml-streaming starts none.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from peers_torch import world
from scenarios import EPOCHS, Scenario, seed_everything, source_ids


def _written(distribution: str, ids: list, write) -> str:
    """The folder of ``ids`` in ``distribution``'s format, filled by ``write`` the first time on this machine:
    every process of a run finds it at the same path (every rank of a job reads one dataset), and a loader's
    threads still reading after a segment ended never find it gone."""
    key = hashlib.sha1(repr((distribution, importlib.metadata.version(distribution), ids)).encode()).hexdigest()
    path = Path(tempfile.gettempdir()) / f"conformance-{distribution}-{key[:16]}"
    if not path.exists():
        staging = Path(tempfile.mkdtemp(prefix=f".{path.name}-"))
        write(str(staging))
        try:
            staging.rename(path)
        except OSError:  # another process wrote it meanwhile
            shutil.rmtree(staging)
    return str(path)


def _chunks(ids: list) -> str:
    def write(out: str) -> None:
        from litdata.streaming.writer import BinaryWriter

        writer = BinaryWriter(out, chunk_size=6)
        for k, i in enumerate(ids):
            writer[k] = {"id": i}
        writer.done()
        writer.merge()

    return _written("litdata", ids, write)


def litdata_segment(scenario: Scenario, folder: Path, segment: int, stop: Optional[int],
                    on_first=None, cost_s: float = 0.0) -> list:
    from litdata import CombinedStreamingDataset, StreamingDataLoader, StreamingDataset

    with _process_group():
        seed_everything()
        parts = [StreamingDataset(_chunks(ids), shuffle=True, drop_last=True, seed=0) for ids in source_ids(scenario)]
        data = parts[0] if len(parts) == 1 else CombinedStreamingDataset(parts, seed=0, weights=[0.5, 0.5],
                                                                         iterate_over_all=False)
        dl = StreamingDataLoader(data, batch_size=scenario.batch(segment), num_workers=scenario.workers)
        return _run_segment(dl, folder, stop, on_first, cost_s)


@contextlib.contextmanager
def _process_group():
    """On several processes, the process group a PyTorch DDP script starts (gloo here), ended after: litdata
    finds its rank there (without it, every process is its rank 0), and mosaicml-streaming uses it rather than
    start and end groups of its own."""
    import torch.distributed as dist

    started = world()[1] > 1 and not dist.is_initialized()
    if started:
        dist.init_process_group("gloo")
    try:
        yield
    finally:
        if started:
            dist.destroy_process_group()


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


def _mds(ids: list) -> str:
    def write(out: str) -> None:
        from streaming import MDSWriter

        with MDSWriter(out=out, columns={"id": "int"}, size_limit=256) as writer:
            for i in ids:
                writer.write({"id": i})

    return _written("mosaicml-streaming", ids, write)


def mosaic_segment(scenario: Scenario, folder: Path, segment: int, stop: Optional[int],
                   on_first=None, cost_s: float = 0.0) -> list:
    """mosaicml-streaming (its "Resumption" guide): ``StreamingDataLoader.state_dict()`` saved, given back to
    ``load_state_dict()``; the dataset's ``batch_size`` is the loader's; a mixture is ``Stream``s with
    proportions."""
    from streaming import Stream, StreamingDataLoader, StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    with _process_group():
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
