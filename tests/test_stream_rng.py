"""A stream that augments resumes bitwise: its draws come from RNG states of its own, recorded with each batch.

An iterable dataset drawing from ``torch``, ``random`` and ``numpy`` in ``__iter__`` is read beside a loop that
draws too (dropout), with the loop's RNGs saved and restored at the save point as Accelerate does. Every save
point and chains of two resumes, through the on-disk format, must give the uninterrupted run's batches and the
loop's draws, bit for bit: shard mode and the dispatcher (whose reader reads one step ahead), a stateful and an
opaque (fast-forwarded) stream, ``num_workers`` 0 (one and two ranks, simulated in one process) and 2.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from accelerate_stateful import DispatchDataLoader, DistContext, IterableShardDataLoader
from harness import through_files
from streams import CountingStream, OpaqueStream

EPOCHS, SIZE = 2, 11


def augment(index: int) -> float:
    return index + float(torch.rand(())) + random.random() + float(np.random.rand())


class AugmentedCounting(CountingStream):
    def __iter__(self):
        return map(augment, super().__iter__())


class AugmentedOpaque(OpaqueStream):
    def __iter__(self):
        return map(augment, super().__iter__())


def rng_states() -> tuple:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def set_rng_states(states: tuple) -> None:
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    np.random.set_state(states[2])


def factory(kind, stream, workers, world, rank):
    def make():
        dl = DataLoader(stream(SIZE), batch_size=2, num_workers=workers)
        cls = DispatchDataLoader if kind == "dispatch" else IterableShardDataLoader
        return cls.from_dataloader(dl, DistContext(rank, world))

    return make


def train(loader, stop=None, taken=0):
    """Batches with the loop's own draws after each; at ``stop`` batches, also the state and the RNGs."""
    steps = []
    for _ in range(loader.epoch, EPOCHS):
        for batch in loader:
            steps.append((batch.tolist(), float(torch.rand(())), random.random(), float(np.random.rand())))
            if stop == taken + len(steps):
                return steps, (loader.state_dict(), rng_states())
    return steps, None


def _configurations():
    for kind, stream, workers, world in itertools.product(("dispatch", "shard"), (AugmentedCounting, AugmentedOpaque),
                                                         (0, 2), (1, 2)):
        if workers and world > 1:  # worker processes are slow to start: one rank covers them
            continue
        yield pytest.param(kind, stream, workers, world, id=f"{kind}-{stream.__name__}-workers{workers}-w{world}")


@pytest.mark.parametrize("kind,stream,workers,world", list(_configurations()))
def test_an_augmenting_stream_resumes_bitwise_beside_a_loop_that_draws_too(kind, stream, workers, world):
    for rank in range(world):
        make = factory(kind, stream, workers, world, rank)
        set_rng_states(_seeded())
        reference, _ = train(make())
        points = range(1, len(reference))
        chains = [[p] for p in points] + [[2, len(reference) - 2]] if not workers else [[3, len(reference) - 1]]
        for chain in chains:
            set_rng_states(_seeded())
            seen, saved = [], None
            for stop in [*chain, None]:
                loader = make()
                if saved is not None:
                    loader.load_state_dict(through_files(saved[0], rank))
                    set_rng_states(saved[1])
                steps, saved = train(loader, stop, taken=len(seen))
                seen += steps
            first = next((i for i, (a, b) in enumerate(zip(reference, seen)) if a != b), None)
            assert seen == reference, f"rank {rank}, saved at {chain}: step {first} differs"


def _seeded() -> tuple:
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    return rng_states()


@pytest.mark.parametrize("kind", ["dispatch", "shard"])
@pytest.mark.parametrize("saved_workers,workers", [(0, 2), (2, 0)])
def test_on_another_num_workers_the_interrupted_epoch_draws_what_it_drew(kind, saved_workers, workers):
    """Each logical worker's (or the main process's) stream continues from its own recorded RNG states."""
    set_rng_states(_seeded())
    reference, _ = train(factory(kind, AugmentedCounting, saved_workers, 1, 0)())
    per_epoch = -(-SIZE // 2)
    set_rng_states(_seeded())
    first, saved = train(factory(kind, AugmentedCounting, saved_workers, 1, 0)(), stop=2)
    loader = factory(kind, AugmentedCounting, workers, 1, 0)()
    loader.load_state_dict(through_files(saved[0], 0))
    set_rng_states(saved[1])
    rest, _ = train(loader, taken=2)
    assert [step[0] for step in first + rest][:per_epoch] == [step[0] for step in reference][:per_epoch]


def test_rng_states_taken_after_a_batch_are_those_of_that_moment_when_a_checkpoint_reads_them_later():
    # A worker takes the states after every batch and puts them in checkpoint types only when they are read
    # (pickled for the main process, or settled in it): later draws must not change what was taken.
    import pickle

    from accelerate_stateful.loaders import _stream_rng

    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    augment(0)
    taken, expected = _stream_rng.Taken(), _stream_rng.record()
    for i in range(50):
        augment(i)
    for read in (taken.settled(), pickle.loads(pickle.dumps(taken))):
        assert read["random"] == expected["random"]
        assert torch.equal(read["torch"], expected["torch"])
        assert read["numpy"][0] == expected["numpy"][0] and read["numpy"][2:] == expected["numpy"][2:]
        assert torch.equal(read["numpy"][1], expected["numpy"][1])
    _stream_rng.apply(taken.settled())
    after_apply = augment(7)
    _stream_rng.apply(expected)
    assert after_apply == augment(7)
