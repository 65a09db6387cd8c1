"""How the ranks read a stream, and whether its position carries over to another number of processes.

Three ways, recorded as ``"reading"`` in a stream loader's state:

- ``whole``: every rank reads the whole stream and keeps its slice of each global batch (Accelerate's
  ``IterableDatasetShard``; one process reads that way too). The position is one count per logical worker
  on one stream, the same on every rank and always on a global-batch boundary, so it continues on any
  number of processes: the new ranks slice the next global batches at their own size.
- ``split``: each rank reads its own part (a ``datasets.IterableDataset`` split by shard): a position
  belongs to one rank's part, so only the same number of processes continues it.

In both, the logical workers of an interrupted epoch continue on any ``num_workers`` (``_shares``).
- ``logical``: logical shards (``ShardedSource``), dealt again to any ranks and workers (``sharded``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import UnsupportedConfigError

WHOLE, SPLIT, LOGICAL = "whole", "split", "logical"
_SAYS = {
    WHOLE: "every process reads the whole stream and keeps its slice of each global batch",
    SPLIT: "each process reads its own shards of the stream (Accelerate splits a datasets.IterableDataset by "
           "shard when it has at least as many shards as processes)",
    LOGICAL: "the stream is read as logical shards",
}


@dataclass(frozen=True)
class Readers:
    """Who reads the stream in this run."""

    reading: str
    world_size: int
    num_workers: int
    num_logical: int  # logical workers per process: max(num_workers, 1)
    dataset: str  # the dataset's class name, for messages


def check_rescale(saved: Mapping[str, Any], stream: Mapping[str, Any], now: Readers, where: str) -> None:
    """Refuse, in the user's terms, another topology that the saved stream position cannot continue on.

    Args:
        saved: The state's topology (``world_size``, ``num_workers``).
        stream: The state's stream entry (``reading``, ``workers``).
        now: This run's readers.
        where: `` in <file>`` for messages, or empty.
    """
    was = f"{_count(saved.get('world_size'), 'process')} with {_count(saved.get('num_workers'), 'worker')}"
    reading = stream.get("reading")
    if reading != now.reading and reading in _SAYS:
        raise UnsupportedConfigError(
            f"cannot resume{where}: the checkpoint was written on {was}, where {_SAYS[reading]}; on "
            f"{_count(now.world_size, 'process')} {_SAYS[now.reading]}, so the position does not carry over; "
            f"relaunch with --num_processes {saved.get('world_size')}, or read the stream as logical shards "
            "(HFShards, or the ShardedSource protocol) to change the number of processes"
        )
    if now.reading == LOGICAL:
        return
    if reading == WHOLE or saved.get("world_size") == now.world_size:
        return  # the workers' shares continue on any num_workers (check_shares)
    raise UnsupportedConfigError(
        f"cannot resume{where}: the checkpoint was written on {was}, this is "
        f"{_count(now.world_size, 'process')}; {now.dataset} resumes only on the same number of processes "
        "(each process read its own shards, and a position belongs to each process's part of the stream; "
        "num_workers may change); implement the ShardedSource protocol (num_shards/open_shard) to make it "
        f"elastic, or relaunch with --num_processes {saved.get('world_size')}"
    )


def shown_workers(stream: Mapping[str, Any], saved: Mapping[str, Any]) -> int:
    """The ``num_workers`` that read the logical workers of the saved epoch (0: the main process)."""
    return int(stream.get("num_workers", saved.get("num_workers") or 0))


def check_shares(stream: Mapping[str, Any], saved: Mapping[str, Any], reader: Any, where: str) -> None:
    """Refuse a saved epoch's logical workers that this loader cannot continue exactly.

    ``reader`` is the loader's ``StreamDataset``. The user's ``worker_init_fn`` runs once per worker
    process for the share it plays; a reader that continues several shares, or the main process's
    stream in a worker (or a worker's in the main process), has no worker process per share to run it in.
    """
    count, shown = stream.get("workers"), shown_workers(stream, saved)
    if not isinstance(count, int) or count < 1 or shown not in (0, count):
        raise UnsupportedConfigError(
            f"cannot resume{where}: inconsistent stream position {dict(stream)!r}; the file is damaged or was "
            "edited by hand, resume from another checkpoint"
        )
    workers = reader.readers if reader.in_workers else 0
    if reader.worker_init is None or (count <= max(workers, 1) and (shown > 0) == (workers > 0)):
        return
    raise UnsupportedConfigError(
        f"cannot resume{where}: the interrupted epoch was read by {_count(shown, 'worker')} and this loader has "
        f"num_workers={workers} and a worker_init_fn, which runs once per worker process for the one share of "
        f"the stream it reads; pass num_workers={shown} (the number of workers may change from the next "
        "epoch on, by resuming from a checkpoint taken at an epoch's end), or configure the dataset in its "
        "__iter__ from get_worker_info() instead of worker_init_fn"
    )


def _count(n: Any, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}es" if noun.endswith("s") else f"{n} {noun}s"
