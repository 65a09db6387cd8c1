"""A new batch size on resume: the rest of the interrupted epoch is cut into batches of the new size from the
first sample nobody took, and the later epochs are a fresh run's at the new size (ranks simulated in one process).

The position of map-style data counts samples, so any change of the per-rank batch size, of the number of
processes, or of both continues exactly; a loader whose saved position is a place between batches refuses with
the fix.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DataLoader

from accelerate_stateful import DispatchDataLoader, DistContext, ShardDataLoader
from accelerate_stateful.errors import UnsupportedConfigError

from harness import through_files
from streams import CountingStream

N = 37
EPOCHS = 3


def shard(world, rank, batch, *, drop=False, even=True, split=False):
    dl = DataLoader(list(range(N)), batch_size=batch, shuffle=True, drop_last=drop,
                    generator=torch.Generator().manual_seed(5))
    return ShardDataLoader.from_dataloader(dl, DistContext(rank, world), even_batches=even, split_batches=split)


def take(loader, steps):
    """The first ``steps`` batches (fewer where this rank's share ends first, ``even_batches=False``), and the state."""
    it = iter(loader)
    got = [next(it).tolist() for _ in range(min(steps, len(loader)))]
    state = loader.state_dict()
    del it
    return got, state


def in_step_order(per_rank):
    """Every rank's batches, interleaved step by step (rank 0's first): the epoch's global order as taken."""
    return [i for step in itertools.zip_longest(*per_rank, fillvalue=[]) for batch in step for i in batch]


def resume(make, world, states):
    """Loaders of ``world`` ranks resumed as ``load_state`` does: each rank's own state on the same number of
    processes, else the main process's."""
    loaders = [make(world, r) for r in range(world)]
    for rank, loader in enumerate(loaders):
        own = rank if world == len(states) else 0
        loader.load_state_dict(through_files(states[own], own))
    return loaders


def rest_and_later(loaders):
    """Each loader's rest of the epoch, then its later epochs, as lists of batches."""
    out = []
    for loader in loaders:
        epochs = [[b.tolist() for b in loader]]
        while loader.epoch < EPOCHS:
            epochs.append([b.tolist() for b in loader])
        out.append(epochs)
    return out


def _cases():
    batches = [(3, 5), (5, 2), (4, 4), (2, 7)]
    for (world, new_world), (b, new_b), drop, even, split in itertools.product(
            [(1, 1), (2, 2), (3, 3), (2, 3), (3, 1), (1, 2)], batches, [False, True], [False, True], [False, True]):
        if (world, b) == (new_world, new_b):
            continue
        if split:  # a global batch divisible by every world size used
            b, new_b = 6 * b, 6 * new_b
        label = f"w{world}b{b}-to-w{new_world}b{new_b}-{'drop' if drop else 'keep'}-{'even' if even else 'uneven'}"
        yield pytest.param(world, new_world, b, new_b, drop, even, split, id=label + ("-split" if split else ""))


@pytest.mark.parametrize("world,new_world,b,new_b,drop,even,split", list(_cases()))
def test_the_rest_of_the_epoch_is_cut_at_the_new_batch_size_and_later_epochs_are_a_fresh_runs(
        world, new_world, b, new_b, drop, even, split):
    make_old = lambda w, r: shard(w, r, b, drop=drop, even=even, split=split)  # noqa: E731
    make_new = lambda w, r: shard(w, r, new_b, drop=drop, even=even, split=split)  # noqa: E731
    order = [i for batch in shard(1, 0, N) for i in batch.tolist()]  # epoch 0's order, on any setup
    fresh = [make_new(new_world, r) for r in range(new_world)]
    for loader in fresh:
        loader.set_epoch(1)
    fresh_later = rest_and_later(fresh)
    per_rank = new_b // new_world if split else new_b
    steps_in_epoch = len(make_old(world, 0))
    fewest = len(make_old(world, world - 1))  # (a share that ends a step early, even_batches=False)
    ends = [steps_in_epoch] if fewest == steps_in_epoch else []
    for steps in sorted({0, 1, fewest // 2, max(fewest - 1, 0), *ends}):
        taken = [take(make_old(world, r), steps) for r in range(world)]
        consumed = in_step_order([got for got, _ in taken])
        assert consumed[:N] == order[: len(consumed[:N])]  # (padded at the end with the first samples)
        resumed = resume(make_new, new_world, [state for _, state in taken])
        padding = resumed[0]._plan.padding
        rests = rest_and_later(resumed)
        if steps == steps_in_epoch:  # saved after the epoch's last batch: its rest is empty, then a fresh run's
            assert [rest[0] for rest in rests] == [[]] * new_world
            assert [rest[1:] for rest in rests] == fresh_later
            continue
        delivered = in_step_order([rest[0] for rest in rests])
        start = len(consumed)
        left = N - start
        if drop:
            assert delivered == order[start: start + left - left % (per_rank * new_world)], steps
        else:
            padded = order[start:] + [order[i % N] for i in range(padding)]  # (wrapping to the epoch's start)
            assert delivered == padded, steps
        for rest in rests:  # batches of the new size; only a last one short (nothing to pad it with)
            assert all(len(batch) == per_rank for batch in rest[0][:-1]), steps
        assert [rest[1:] for rest in rests] == fresh_later, steps


@pytest.mark.parametrize("worlds,batches", [((2, 2, 2), (3, 4, 2)), ((2, 3, 1), (3, 2, 5)), ((1, 3, 2), (4, 4, 3))],
                         ids=["same-world", "worlds-and-batches", "world-then-batch"])
def test_a_chain_of_resumes_delivers_every_sample_of_the_epoch_once(worlds, batches):
    """Saved after one step on each setup and resumed on the next: the epoch is its order, each sample once."""
    loaders = [shard(worlds[0], r, batches[0], even=False) for r in range(worlds[0])]
    delivered = []
    for world, batch in zip(worlds[1:], batches[1:]):
        taken = [take(loader, 1) for loader in loaders]
        delivered += in_step_order([got for got, _ in taken])
        loaders = resume(lambda w, r: shard(w, r, batch, even=False), world, [s for _, s in taken])  # noqa: B023
    delivered += in_step_order([[b.tolist() for b in loader] for loader in loaders])
    assert delivered == [i for batch in shard(1, 0, N) for i in batch.tolist()]


def dispatcher(world, rank, batch, *, drop=False, split=False, dataset=None):
    data = list(range(N)) if dataset is None else dataset
    dl = DataLoader(data, batch_size=batch, drop_last=drop, shuffle=dataset is None,
                    generator=torch.Generator().manual_seed(5) if dataset is None else None)
    return DispatchDataLoader.from_dataloader(dl, DistContext(rank, world), split_batches=split)


@pytest.mark.parametrize("world,new_world", [(2, 2), (2, 3), (3, 1)])
@pytest.mark.parametrize("b,new_b", [(2, 3), (3, 1)])
@pytest.mark.parametrize("drop", [False, True], ids=["keep", "drop"])
def test_the_dispatcher_continues_at_another_batch_size(world, new_world, b, new_b, drop):
    def stream(loaders):
        return in_step_order([[batch.tolist() for batch in loader] for loader in loaders])

    def fresh_epoch_1():
        loaders = [dispatcher(new_world, r, new_b, drop=drop) for r in range(new_world)]
        for loader in loaders:
            loader.set_epoch(1)
        return stream(loaders)

    order, later = stream([dispatcher(1, 0, N)]), fresh_epoch_1()
    total = len(dispatcher(world, 0, b, drop=drop))
    for steps in range(total + 1):
        taken = [take(dispatcher(world, r, b, drop=drop), steps) for r in range(world)]
        consumed = in_step_order([got for got, _ in taken])
        resumed = [dispatcher(new_world, r, new_b, drop=drop) for r in range(new_world)]
        merged = resumed[0].merge_rank_states([through_files(state, r) for r, (_, state) in enumerate(taken)])
        for loader in resumed:
            loader.load_state_dict(merged)
        lengths = [(loader.batches_yielded, len(loader)) for loader in resumed]
        rest = stream(resumed)
        if steps == total:  # saved after the epoch's last step: its rest is empty, the next epoch a fresh run's
            assert rest == [] and stream(resumed) == later
            continue
        start = len(consumed)
        step = new_b * new_world
        if drop:
            assert rest == order[start: start + (N - start) // new_b // new_world * step], steps
        else:
            assert rest[: N - start] == order[start:] and len(rest) % new_world == 0, steps
            assert set(rest[N - start:]) <= set(order[:new_world]), steps  # padding: the epoch's first samples
        assert all(at + len(rest) // step == length for at, length in lengths) or not drop, steps
        assert stream(resumed) == later


def test_the_resume_line_says_the_batch_size_changed(caplog):
    from pathlib import Path

    from accelerate_stateful.checkpoint._lines import log_resume as _log_resume

    _, state = take(shard(2, 0, 3), 2)
    resumed = shard(2, 0, 4)
    resumed.load_state_dict(through_files(state))
    with caplog.at_level("INFO", logger="accelerate_stateful"):
        _log_resume(0, resumed, state, Path("ckpt"))
    assert "loader 0: resuming epoch 0 at 32.4% on 2 ranks x 0 workers with batch_size=4 (was 3) from ckpt" \
        in caplog.text
    assert caplog.records[-1].levelname == "WARNING"


def test_a_users_batch_sampler_refuses_another_batch_size_and_names_the_fix():
    from torch.utils.data import BatchSampler, SequentialSampler

    from accelerate_stateful import BatchSamplerDataLoader

    def make(batch):
        dl = DataLoader(list(range(N)), batch_sampler=BatchSampler(SequentialSampler(range(N)), batch, False))
        return BatchSamplerDataLoader.from_dataloader(dl, DistContext(0, 1))

    _, state = take(make(3), 2)
    with pytest.raises(UnsupportedConfigError, match=r"BatchSampler of batch_size=3, this run's has batch_size=4.*"
                                                     r"resume with the same batch_sampler \(batch_size=3\), or pass "
                                                     r"DataLoader\(batch_size=\.\.\., shuffle=\.\.\.\)"):
        make(4).load_state_dict(through_files(state))


@pytest.mark.parametrize("dispatch", [False, True], ids=["shard", "dispatcher"])
def test_a_stream_changes_batch_size_only_at_an_epochs_end(dispatch):
    def make(batch, world=1, rank=0):
        if dispatch:
            return dispatcher(world, rank, batch, dataset=CountingStream(10))
        from accelerate_stateful import IterableShardDataLoader
        return IterableShardDataLoader.from_dataloader(DataLoader(CountingStream(10), batch_size=batch),
                                                       DistContext(rank, world))

    loader = make(3)
    it = iter(loader)
    next(it), next(it)
    inside = loader.state_dict()
    del it
    with pytest.raises(UnsupportedConfigError, match=r"batch_size=3, this run has batch_size=4, and it was saved "
                                                     r"inside an epoch of a stream.*resume with batch_size=3 until "
                                                     r"the epoch ends"):
        make(4).load_state_dict(through_files(inside))
    first = make(3)
    taken = [b.tolist() for b in first]
    at_end = first.state_dict()
    resumed = make(4)
    resumed.load_state_dict(through_files(at_end))
    next_epoch = [b.tolist() for b in resumed]
    fresh = make(4)
    fresh.set_epoch(1)
    assert sum(len(b) for b in taken) == 10 and next_epoch == [b.tolist() for b in fresh]
    assert [len(b) for b in next_epoch] == [4, 4, 2]


def sampled(world, rank, batch, *, even=True):
    from torch.utils.data.distributed import DistributedSampler

    sampler = DistributedSampler(list(range(N)), num_replicas=world, rank=rank, shuffle=True, seed=3)
    dl = DataLoader(list(range(N)), batch_size=batch, sampler=sampler)
    return ShardDataLoader.from_dataloader(dl, DistContext(rank, world), even_batches=even)


@pytest.mark.parametrize("setups", [((2, 2), (2, 3), (3, 1)), ((3, 2), (2, 2), (1, 3))],
                         ids=["2x2-2x3-3x1", "3x2-2x2-1x3"])
@pytest.mark.parametrize("even", [True, False], ids=["even", "uneven"])
def test_your_own_distributed_sampler_continues_its_epoch_at_another_batch_size(setups, even):
    """The epoch is the first setup's order (its processes' shares in steps of its batch size); after two changes
    of batch size (and processes) inside it, every entry of that order comes once, in order."""
    (world, batch), rest = setups[0], setups[1:]
    first = [sampled(world, r, batch, even=even) for r in range(world)]
    order = in_step_order([[b.tolist() for b in loader] for loader in first])
    loaders = [sampled(world, r, batch, even=even) for r in range(world)]
    delivered = []
    for new_world, new_batch in rest:
        taken = [take(loader, 1) for loader in loaders]
        delivered += in_step_order([got for got, _ in taken])
        loaders = resume(lambda w, r: sampled(w, r, new_batch, even=even), new_world,  # noqa: B023
                         [state for _, state in taken])
    padding = loaders[0]._plan.padding
    delivered += in_step_order([[b.tolist() for b in loader] for loader in loaders])
    assert delivered == order + [order[i % len(order)] for i in range(padding)]  # padded with the order's start
    for loader in loaders:
        loader.set_epoch(1)
    fresh = [sampled(rest[-1][0], r, rest[-1][1], even=even) for r in range(rest[-1][0])]
    for loader in fresh:
        loader.set_epoch(1)
    assert [[b.tolist() for b in loader] for loader in loaders] == [[b.tolist() for b in loader] for loader in fresh]


def test_two_loaders_differing_only_by_batch_size_prepared_in_the_other_order_are_refused(tmp_path):
    from accelerate.state import AcceleratorState
    from accelerate.utils import DataLoaderConfiguration

    from accelerate_stateful import Accelerator, CheckpointError

    def prepared(batches):
        AcceleratorState._reset_state(True)
        accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
        return accelerator, accelerator.prepare(*[DataLoader(list(range(N)), batch_size=b) for b in batches])

    accelerator, loaders = prepared((3, 5))
    next(iter(loaders[0]))
    accelerator.save_state(tmp_path / "ckpt")
    accelerator, _ = prepared((5, 3))
    with pytest.raises(CheckpointError, match=r"prepared in another order"):
        accelerator.load_state(tmp_path / "ckpt")
    accelerator, loaders = prepared((4, 5))  # a new batch size for the first: resumed at it
    accelerator.load_state(tmp_path / "ckpt")
    assert [loader.batch_size for loader in loaders] == [4, 5]


def test_a_dispatcher_rank_without_the_readers_state_refuses_another_batch_size_and_says_where_it_resumes():
    """A process's own state (as torch.distributed.checkpoint loads it) lacks the main process's reader."""
    taken = [take(dispatcher(2, r, 3), 1) for r in range(2)]
    with pytest.raises(UnsupportedConfigError, match=r"batch_size=4 \(was 3\).*accelerator.load_state\(\)/resume\(\) "
                                                     r"hands it to every process.*resume with batch_size=3"):
        dispatcher(2, 1, 4).load_state_dict(dict(through_files(taken[1][1], 1), base=None))  # (as a real rank 1's)
