"""Iterable datasets used by the stream tests: stateful, opaque, recording what they read, and a source that
must be read in one place (round-robin)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch.utils.data import IterableDataset, get_worker_info


def _share(n: int, epoch: int) -> list[int]:
    """This worker's ids: ``i % workers == worker``, rotated by the epoch so epochs differ."""
    info = get_worker_info()
    worker, workers = (info.id, info.num_workers) if info else (0, 1)
    mine = [i for i in range(n) if i % workers == worker]
    shift = epoch % len(mine) if mine else 0
    return mine[shift:] + mine[:shift]


class _Cursor:
    """An epoch and a position in it, saved and restored as ``{"pos": ...}``."""

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


class CountingStream(_Cursor, IterableDataset):
    """A stateful stream of ids that resumes from a position, and can log every id it reads to a folder."""

    def __init__(self, n: int, log_dir: Optional[Path] = None) -> None:
        self.n, self.log_dir = n, log_dir
        self.pos, self.epoch = 0, 0

    def __iter__(self):
        mine = _share(self.n, self.epoch)
        while self.pos < len(mine):
            item = mine[self.pos]
            self.pos += 1
            if self.log_dir is not None:
                info = get_worker_info()
                with open(self.log_dir / f"read_{info.id if info else 'main'}", "a") as log:
                    log.write(f"{item}\n")
            yield item


class OpaqueStream(IterableDataset):
    """A stream that cannot report its position (no state_dict)."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(_share(self.n, self.epoch))


class OpenOnce(_Cursor):
    """A stream (think: a cursor or a queue) that fails loudly if it is opened twice or inside a worker.

    Epoch ``e`` reads the ids ``0..n-1`` rotated by ``7 * e`` (``order``), so epochs differ.
    """

    def __init__(self, n: int) -> None:
        self.n, self.pos, self.epoch, self.opened = n, 0, 0, set()

    @staticmethod
    def order(n: int, epoch: int) -> list[int]:
        return [(i + 7 * epoch) % n for i in range(n)]

    def __iter__(self):
        if get_worker_info() is not None:
            raise RuntimeError("the source was opened inside a worker: it was replicated")
        if self.epoch in self.opened:
            raise RuntimeError(f"the source was opened twice in epoch {self.epoch}")
        self.opened.add(self.epoch)
        order = self.order(self.n, self.epoch)
        while self.pos < self.n:
            self.pos += 1
            yield order[self.pos - 1]


def decode(raw: int) -> dict:
    """The per-sample work of a round-robin source, done in a worker: ``worker`` says which (-1: none)."""
    info = get_worker_info()
    return {"id": raw, "worker": -1 if info is None else info.id}


def read_log(log_dir: Path) -> list[int]:
    return sorted(int(line) for path in log_dir.glob("read_*") for line in path.read_text().split())


class HeavyStateStream(CountingStream):
    """A stream whose state is large (a tensor bigger than a pipe's buffer) and whose position lives in a list.

    With ``live=True``, ``state_dict()`` returns its own list and tensor, which later reads change in place:
    a snapshot kept by reference would report a later position than the batch it was taken after.
    """

    def __init__(self, n: int, live: bool, payload: int = 100_000) -> None:
        self.live = live
        self.cursor = [0]
        self.payload = torch.zeros(payload, dtype=torch.int64)
        super().__init__(n)

    @property
    def pos(self) -> int:
        return self.cursor[0]

    @pos.setter
    def pos(self, value: int) -> None:
        self.cursor[0] = value  # in place, as a buffer or a generator state changes
        self.payload[0] = value

    def state_dict(self) -> dict:
        if self.live:
            return {"cursor": self.cursor, "payload": self.payload}
        return {"cursor": list(self.cursor), "payload": self.payload.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.cursor = list(state["cursor"])
        self.payload = state["payload"].clone()
        assert int(self.payload[0]) == self.cursor[0], "the payload does not belong to this position"

