"""How the ranks read a stream, and whether its position carries over to another number of processes.

Three ways, recorded as ``"reading"`` in a stream loader's state:

- ``whole``: every rank reads the whole stream and keeps its slice of each global batch (Accelerate's
  ``IterableDatasetShard``; one process reads that way too). The position is one count per worker on one
  stream, the same on every rank and always on a global-batch boundary, so it continues on any number of
  processes with the same number of logical workers (0 and 1 workers both read the stream whole): the new
  ranks slice the next global batches at their own size.
- ``split``: each rank reads its own part (a ``datasets.IterableDataset`` split by shard): a position
  belongs to one rank's part, so only the same number of processes continues it.
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
    if now.reading == WHOLE and reading == WHOLE:
        if stream.get("workers") == now.num_logical:
            return
        raise UnsupportedConfigError(
            f"cannot resume{where}: the checkpoint was written on {was}, this loader has "
            f"{_count(now.num_workers, 'worker')}; each worker reads its own share of {now.dataset} and its "
            f"position belongs to that share, so pass num_workers={saved.get('num_workers')} (the number of "
            "processes may change)"
        )
    raise UnsupportedConfigError(
        f"cannot resume{where}: the checkpoint was written on {was}, this is {now.world_size} with "
        f"{now.num_workers}; {now.dataset} resumes only on the same number of processes and workers (each "
        "process read its own shards, and a position belongs to each reader's share of the stream); implement "
        "the ShardedSource protocol (num_shards/open_shard) to make it elastic, or relaunch with "
        f"--num_processes {saved.get('world_size')} and num_workers={saved.get('num_workers')}"
    )


def _count(n: Any, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}es" if noun.endswith("s") else f"{n} {noun}s"
