"""Leaving samples out (a loss spike's batches): ranges of positions of an epoch's order, kept in the state, left
out by every later resume on any number of processes and batch size (ranks simulated in one process)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DataLoader

from accelerate_stateful import DispatchDataLoader, DistContext, ShardDataLoader
from accelerate_stateful.errors import UnsupportedConfigError

from harness import through_files
from streams import CountingStream

N = 40


def shard(world, rank, batch=2, *, even=False, drop=False):
    dl = DataLoader(list(range(N)), batch_size=batch, shuffle=True, drop_last=drop,
                    generator=torch.Generator().manual_seed(3))
    return ShardDataLoader.from_dataloader(dl, DistContext(rank, world), even_batches=even)


def dispatcher(world, rank, batch=2):
    dl = DataLoader(list(range(N)), batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(3))
    return DispatchDataLoader.from_dataloader(dl, DistContext(rank, world))


def in_step_order(per_rank):
    return [i for step in itertools.zip_longest(*per_rank, fillvalue=[]) for batch in step for i in batch]


def take(loaders, steps):
    """``steps`` steps of every rank, and each rank's state after them."""
    got, states = [], []
    for loader in loaders:
        it = iter(loader)
        got.append([next(it).tolist() for _ in range(min(steps, len(loader)))])
        states.append(through_files(loader.state_dict(), loader.ctx.rank))
        del it
    return in_step_order(got), states


def resumed(make, world, states, skip=None, before=False):
    """``world`` ranks loaded as ``load_state`` loads them, ``skip`` given after the load (or before it)."""
    loaders = [make(world, r) for r in range(world)]
    for rank, loader in enumerate(loaders):
        if skip and before:
            loader.skip_samples(*skip)
        loader.load_state_dict(states[rank] if world == len(states) else states[0])
        if skip and not before:
            loader.skip_samples(*skip)
    return loaders


ORDER = [i for b in shard(1, 0, N) for i in b.tolist()]


def _cases():
    for (world, new_world), (b, new_b), kind, before in itertools.product(
            [(1, 1), (2, 2), (2, 3), (3, 1)], [(2, 2), (2, 3)], ["shard", "dispatcher"], [False, True]):
        yield pytest.param(world, new_world, b, new_b, kind, before,
                           id=f"{kind}-w{world}b{b}-to-w{new_world}b{new_b}" + ("-given-before-resume" if before else ""))


@pytest.mark.parametrize("world,new_world,b,new_b,kind,before", list(_cases()))
def test_the_skipped_range_is_left_out_of_this_and_every_later_resume(world, new_world, b, new_b, kind, before):
    make = (lambda w, r, batch: shard(w, r, batch)) if kind == "shard" else dispatcher
    taken, states = take([make(world, r, b) for r in range(world)], 2)  # the checkpoint before the spike
    spike = (len(taken) + 3, len(taken) + 9)
    first = resumed(lambda w, r: make(w, r, new_b), new_world, states, spike, before)
    assert first[0].skipped_samples == [(0, *spike)]
    more, again = take(first, 1)  # saved once more after the skip, resumed on the saved setup: still left out
    last = resumed(lambda w, r: make(w, r, b), world, again)
    rest = in_step_order([[batch.tolist() for batch in loader] for loader in last])
    delivered = taken + more + rest
    expected = ORDER[: spike[0]] + ORDER[spike[1]:]
    if kind == "shard":  # (uneven: the order as it is, each sample once)
        assert delivered == expected
    else:  # the dispatcher pads its last step with the epoch's first samples
        assert delivered[: len(expected)] == expected and set(delivered[len(expected):]) <= set(ORDER[:world])
    fresh = [make(world, r, b) for r in range(world)]
    for loader in fresh:
        loader.set_epoch(1)
    assert [[x.tolist() for x in loader] for loader in last] == [[x.tolist() for x in loader] for loader in fresh]


@pytest.mark.parametrize("even,drop", [(True, False), (False, True)], ids=["even", "drop"])
def test_a_skipped_epoch_is_padded_or_cut_as_a_shorter_epoch(even, drop):
    loaders = [shard(2, r, 3, even=even, drop=drop) for r in range(2)]
    for loader in loaders:
        loader.skip_samples(0, 5, epoch=1)  # a later epoch
        loader.set_epoch(1)
    got = in_step_order([[b.tolist() for b in loader] for loader in loaders])
    fresh = shard(1, 0, N)
    fresh.set_epoch(1)
    order = [i for b in fresh for i in b.tolist()][5:]
    if drop:
        assert got == order[: len(order) // 6 * 6]
    else:
        assert got == order + order[: -len(order) % 6]  # padded with the shorter epoch's first samples


def test_ranges_given_before_the_loaders_position_or_outside_the_epoch_are_refused():
    loader = shard(1, 0)
    taken, states = take([loader], 3)
    resumed_loader = resumed(lambda w, r: shard(w, r), 1, states)[0]
    with pytest.raises(UnsupportedConfigError, match=r"already took the samples of epoch 0 before position 6; "
                                                     r"resume from a checkpoint saved before position 4"):
        resumed_loader.skip_samples(4, 8)
    with pytest.raises(UnsupportedConfigError, match=r"outside the epoch's 40 samples"):
        resumed_loader.skip_samples(30, 41)
    resumed_loader.set_epoch(2)
    with pytest.raises(UnsupportedConfigError, match=r"already in epoch 2; samples of a past epoch"):
        resumed_loader.skip_samples(0, 1, epoch=1)
    early = shard(1, 0)
    early.skip_samples(2, 4)  # before resume(): checked against the checkpoint's position when it loads
    with pytest.raises(UnsupportedConfigError, match=r"before position 6"):
        early.load_state_dict(states[0])


def test_a_stream_refuses_to_skip_samples_and_says_where_to_leave_them_out():
    from accelerate_stateful import IterableShardDataLoader

    loader = IterableShardDataLoader.from_dataloader(DataLoader(CountingStream(10), batch_size=2), DistContext(0, 1))
    with pytest.raises(UnsupportedConfigError, match=r"skip_samples\(\) needs map-style data.*filter them in "
                                                     r"__iter__"):
        loader.skip_samples(0, 2)


def test_processes_that_skip_different_samples_do_not_agree():
    from accelerate_stateful.checkpoint._in_step import _in_words

    a, b = shard(2, 0), shard(2, 1)
    a.skip_samples(4, 6)
    assert a._digest()[0] != b._digest()[0]
    assert _in_words(a._digest()[1]).endswith(", leaving out samples [4, 6) of epoch 0")  # how the refusal says it
    b.skip_samples(4, 6)
    assert a._digest()[0] == b._digest()[0]


def test_the_resume_line_and_inspect_name_the_skipped_samples(caplog, tmp_path):
    from pathlib import Path

    from accelerate_stateful.checkpoint._lines import log_resume as _log_resume

    _, states = take([shard(1, 0)], 2)
    loader = resumed(lambda w, r: shard(w, r), 1, states, (10, 14))[0]
    with caplog.at_level("INFO", logger="accelerate_stateful"):
        _log_resume(0, loader, states[0], Path("ckpt"))
    assert "resuming epoch 0 at 11.1% on 1 ranks x 0 workers, leaving out samples [10, 14) of epoch 0, from ckpt" \
        in caplog.text
    state = loader.state_dict()
    assert state["skipped_samples"] == [[0, 10, 14]]


@pytest.mark.parametrize("kind", ["shard", "dispatcher"])
def test_inspect_reads_the_skipped_samples_and_the_shorter_epoch_as_the_resumed_loader_does(kind):
    from accelerate_stateful.cli._loaders import rank_batches, restored_loader
    from accelerate_stateful.cli._report import _map_position

    make = (lambda w, r: shard(w, r, 3, even=True)) if kind == "shard" else (lambda w, r: dispatcher(w, r, 3))
    _, states = take([make(2, r) for r in range(2)], 1)
    loaders = resumed(make, 2, states, (9, 20))
    _, states = take(loaders, 1)
    for rank in range(2):
        read = _map_position(None, 0, states, rank)
        loader = restored_loader(states, rank, 2)
        assert read["skipped_samples"] == [[0, 9, 20]]
        assert (read["batches_in_epoch"], read["epoch_fraction"]) == (len(loader), loader.progress())
        assert read["samples_in_epoch"] == N - 11
        listed = rank_batches(restored_loader(states, rank, 2), loader.batches_yielded)  # what `samples` prints
        assert listed == [b.tolist() for b in loader] and not set(ORDER[9:20]) & {i for b in listed for i in b}


def test_the_dispatcher_places_a_range_after_a_seek_and_refuses_one_it_cannot_place():
    loader = dispatcher(2, 1)
    loader.seek(3)  # skip_first_batches: 3 steps of 4 samples
    with pytest.raises(UnsupportedConfigError, match=r"before position 12"):
        loader.skip_samples(8, 10)
    loader.skip_samples(12, 14)
    assert loader.skipped_samples == [(0, 12, 14)]
    _, states = take([dispatcher(2, r) for r in range(2)], 1)
    earlier = {k: v for k, v in states[0].items() if k != "samples_taken"}  # as an earlier release wrote it
    resumed_loader = dispatcher(2, 0)
    resumed_loader.load_state_dict(earlier)
    with pytest.raises(UnsupportedConfigError, match=r"written by an earlier release.*save a checkpoint with this"):
        resumed_loader.skip_samples(20, 22)
