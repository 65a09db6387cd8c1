"""WebDataset tar shards (``webdataset`` 1.0.2), written with its own ``TarWriter`` and read as users read them.

A ``WebDataset`` has no ``state_dict()``: it is an opaque iterable (docs/sources/streaming.md). Resumed, it is
fast-forwarded over the samples already taken, with the warning that counts them, and the rest of the run is
the uninterrupted run's: with the saved number of workers, with another (each saved worker's share goes on,
``docs/elastic.md``), and on another number of processes.
"""

from __future__ import annotations

import logging

import pytest
import webdataset as wds  # an extra `make test` installs (setup.py STREAMING); never skipped
from torch.utils.data import DataLoader

from accelerate_stateful import DistContext, IterableShardDataLoader
from accelerate_stateful.checkpoint._resume import shared_state

from harness import through_files

SHARDS, PER_SHARD, BATCH = 4, 10, 3


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wds")
    found = []
    for shard in range(SHARDS):
        path = folder / f"shard-{shard:02d}.tar"
        with wds.TarWriter(str(path)) as writer:
            for i in range(PER_SHARD):
                number = shard * PER_SHARD + i
                writer.write({"__key__": f"sample{number:04d}", "cls": str(number).encode()})
        found.append(str(path))
    return found


def number(sample: dict) -> int:
    return int(sample["cls"])


def make(urls, workers, world=1, rank=0):
    dataset = wds.WebDataset(urls, shardshuffle=False, empty_check=False).map(number)
    dl = DataLoader(dataset, batch_size=BATCH, num_workers=workers, collate_fn=list)
    return IterableShardDataLoader.from_dataloader(dl, DistContext(rank, world))


def run(loader, stop=None):
    """Batches of one epoch, up to ``stop`` of them (then also the state there)."""
    taken = []
    for batch in loader:
        taken.append(batch)
        if len(taken) == stop:
            return taken, loader.state_dict()
    return taken, None


@pytest.mark.parametrize("saved,now", [(0, 0), (2, 2), (2, 1), (0, 2), (2, 0), (1, 3)])
def test_a_resume_is_fast_forwarded_counted_and_goes_on_as_the_uninterrupted_run(urls, saved, now, caplog):
    uninterrupted, _ = run(make(urls, saved))
    head, state = run(make(urls, saved), 4)
    resumed = make(urls, now)
    with caplog.at_level(logging.WARNING, logger="accelerate_stateful"):
        resumed.load_state_dict(through_files(state))
        rest, _ = run(resumed)
    assert head + rest == uninterrupted
    assert sorted(n for batch in head + rest for n in batch) == list(range(SHARDS * PER_SHARD))
    assert "WebDataset has no state_dict()" in caplog.text and "reads and drops the 12 samples" in caplog.text


def test_two_processes_resumed_on_three_deliver_every_sample_not_taken_once(urls):
    taken, states = [], []
    for rank in range(2):
        loader = make(urls, 0, 2, rank)
        batches, state = run(loader, 3)
        taken += [n for batch in batches for n in batch]
        states.append(through_files(state, rank))
    rest = []
    for rank in range(3):
        loader = make(urls, 0, 3, rank)
        loader.load_state_dict(shared_state(loader, None, states[0], lambda: list(states)))
        rest += [n for batch in run(loader)[0] for n in batch]
    assert len(taken) == len(set(taken)) == 2 * 3 * BATCH
    fresh = [n for n in rest if n not in set(taken)]
    assert sorted(set(fresh)) == sorted(set(range(SHARDS * PER_SHARD)) - set(taken))
    assert len(rest) - len(set(fresh)) < BATCH * 3  # only the padding that completes the last global batch
