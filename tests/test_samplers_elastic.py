"""A user's DistributedSampler saved on W processes continues exactly on W' (ranks simulated in one process).

The interrupted epoch is the W-process run's: its global order is every rank's batches, step by step (what
Accelerate delivers from a DistributedSampler on W processes); the rest of it, from the first sample nobody
took, is delivered once across the W' ranks, nothing taken comes back (besides the padding `even_batches`
adds to the resumed epoch's last step); later epochs are a fresh W'-process run's.
"""

from __future__ import annotations

import itertools

import pytest
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from accelerate_stateful import DistContext, ShardDataLoader, StateMismatchError

from harness import through_files

EPOCHS = 3
BATCH = 3


def loader(world, rank, n, *, shuffle, drop_last, even, seed=3):
    sampler = DistributedSampler(list(range(n)), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
    dl = DataLoader(list(range(n)), batch_size=BATCH, sampler=sampler, drop_last=drop_last)
    return ShardDataLoader.from_dataloader(dl, DistContext(rank, world), even_batches=even)


def accelerate_batches(world, rank, n, epoch, *, shuffle, drop_last, even, seed=3):
    """What Accelerate's own loader hands rank ``rank`` in ``epoch``: its shard of the DistributedSampler's batches."""
    sampler = DistributedSampler(list(range(n)), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
    sampler.set_epoch(epoch)
    batches = BatchSampler(sampler, BATCH, drop_last)
    if world == 1:
        return [list(b) for b in batches]
    return [list(b) for b in BatchSamplerShard(batches, num_processes=world, process_index=rank, even_batches=even)]


def steps_of(per_rank):
    """Every rank's batches, step by step: the global order of what the ranks took."""
    return [b for step in itertools.zip_longest(*per_rank) for b in step if b is not None]


def flat(batches):
    return [i for b in batches for i in b]


def loop(loader):
    """The README's loop: ``for epoch in range(dl.epoch, EPOCHS): for batch in dl``; each epoch's batches."""
    read = {}
    for epoch in range(loader.epoch, EPOCHS):
        read[epoch] = [b.tolist() for b in loader]
    return read


def settings():
    for world, new_world, shuffle, drop, even in itertools.product([1, 2, 3], [1, 2, 3, 4], [False, True],
                                                                   [False, True], [False, True]):
        if world != new_world:
            yield pytest.param(world, new_world, shuffle, drop, even,
                               id=f"{world}to{new_world}-{'shuffle' if shuffle else 'seq'}-"
                                  f"{'drop' if drop else 'keep'}-{'even' if even else 'uneven'}")


@pytest.mark.parametrize("n", [37, 38])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("shuffle,drop,even", list(itertools.product([False, True], repeat=3)))
def test_on_the_same_number_of_processes_every_rank_reads_what_accelerate_gives_it(n, world, shuffle, drop, even):
    kw = dict(shuffle=shuffle, drop_last=drop, even=even)
    for rank in range(world):
        ours = loader(world, rank, n, **kw)
        for epoch in range(EPOCHS):
            assert [b.tolist() for b in ours] == accelerate_batches(world, rank, n, epoch, **kw), (rank, epoch)


@pytest.mark.parametrize("world,new_world,shuffle,drop,even", list(settings()))
def test_the_rest_of_the_epoch_continues_on_another_number_of_processes(world, new_world, shuffle, drop, even):
    n, kw = 37, dict(shuffle=shuffle, drop_last=drop, even=even)
    epoch0 = [accelerate_batches(world, r, n, 0, **kw) for r in range(world)]
    order = flat(steps_of(epoch0))  # what the W-process run delivers in epoch 0, in its global order
    steps = min(len(b) for b in epoch0)  # save points every rank reaches (ranks differ with uneven batches)
    ends = {steps} if all(len(b) == steps for b in epoch0) else set()  # the epoch's end, when every rank has it
    for taken in sorted({0, 1, steps // 2, steps - 1} - {-1} | ends):
        states, consumed = [], []
        for rank in range(world):
            old = loader(world, rank, n, **kw)
            it = iter(old)
            consumed += [next(it).tolist() for _ in range(min(taken, len(old)))]
            states.append(through_files(old.state_dict(), rank))
            del it
        resumed = [loader(new_world, r, n, **kw) for r in range(new_world)]
        merged = resumed[0].merge_rank_states(states)
        for new in resumed:
            new.load_state_dict(merged)
        padding = resumed[0]._plan.padding
        reads = [loop(new) for new in resumed]
        if taken == 0:  # an epoch nobody began is the new number of processes' own, as in a fresh run there
            for rank, read in enumerate(reads):
                assert read[0] == accelerate_batches(new_world, rank, n, 0, **kw)
        if 0 < taken and taken not in ends:  # inside the epoch: the W-process order continues; at its end epoch 1 comes next
            delivered = flat(steps_of([read[0] for read in reads]))
            assert sorted(flat(consumed)) == sorted(order[:len(flat(consumed))]), taken
            real, start = delivered[:len(delivered) - padding], len(flat(consumed))
            assert real == order[start:start + len(real)], taken  # nothing taken comes back, nothing repeated
            left = len(order) - start - len(real)  # nothing lost, but the tail drop_last drops on W' (as any run)
            assert left == 0 or (drop and left < new_world * BATCH), (taken, left)
        for epoch in range(1, EPOCHS):  # later epochs: a fresh run on the new number of processes
            for rank, read in enumerate(reads):
                assert read[epoch] == accelerate_batches(new_world, rank, n, epoch, **kw), (taken, epoch)


@pytest.mark.parametrize("chain", [(2, 3, 1), (3, 2, 4), (1, 3, 2)], ids=lambda c: "to".join(map(str, c)))
def test_a_second_change_inside_the_same_epoch_keeps_the_first_worlds_order(chain):
    n, kw = 40, dict(shuffle=True, drop_last=False, even=True)
    order = flat(steps_of([accelerate_batches(chain[0], r, n, 0, **kw) for r in range(chain[0])]))
    states = None
    taken: list = []
    for world in chain[:-1]:
        loaders = [loader(world, r, n, **kw) for r in range(world)]
        if states is not None:
            merged = loaders[0].merge_rank_states(states)
            for one in loaders:
                one.load_state_dict(merged)
        iters = [iter(one) for one in loaders]
        got = [[next(it).tolist()] for it in iters]  # one step on every rank
        taken += flat(steps_of(got))
        states = [through_files(one.state_dict(), r) for r, one in enumerate(loaders)]
        del iters
    last = [loader(chain[-1], r, n, **kw) for r in range(chain[-1])]
    merged = last[0].merge_rank_states(states)
    for one in last:
        one.load_state_dict(merged)
    padding = last[0]._plan.padding
    rest = flat(steps_of([[b.tolist() for b in one] for one in last]))
    assert taken == order[:len(taken)]
    assert rest[:len(rest) - padding] == order[len(taken):]


def test_the_same_number_of_processes_resumes_a_state_of_an_earlier_release():
    n, kw = 37, dict(shuffle=True, drop_last=False, even=True)
    for rank in range(2):
        ours = loader(2, rank, n, **kw)
        it = iter(ours)
        taken = [next(it).tolist() for _ in range(len(ours) - 1)]
        state = dict(through_files(ours.state_dict(), rank))
        del it
        # An earlier release counted the samples of one process's share striped over the processes.
        share = -(-n // 2)
        state["samples_consumed"] = min(len(taken) * BATCH * 2, share)
        for key in ("order_fingerprint", "order_world_size"):
            state.pop(key)
        again = loader(2, rank, n, **kw)
        again.load_state_dict(state)
        assert taken + [b.tolist() for b in again] == accelerate_batches(2, rank, n, 0, **kw)


def test_a_distributed_sampler_seed_changed_between_save_and_resume_is_refused():
    kw = dict(shuffle=True, drop_last=False, even=True)
    old = loader(2, 0, 30, **kw)
    it = iter(old)
    next(it)
    state = through_files(old.state_dict())
    del it
    for world in (2, 3):
        with pytest.raises(StateMismatchError, match=r"the sampler's order for epoch 0 \(DistributedSampler\) differs "
                                                     r"from the one saved \(seed changed\?\)"):
            loader(world, 0, 30, seed=4, **kw).load_state_dict(state)


def test_the_command_line_describes_a_distributed_samplers_checkpoint(tmp_path):
    from cli_run import run_cli, save_checkpoint

    states = []
    for rank in range(2):
        one = loader(2, rank, 37, shuffle=True, drop_last=False, even=True)
        it = iter(one)
        next(it), next(it)
        states.append(one.state_dict())
        del it
    status, out, err = run_cli("inspect", save_checkpoint(tmp_path / "ds", [states]))
    assert status == 0 and err == "", err
    assert "order=sampler:DistributedSampler" in out and "2 of 4         12 of 24 (50.0%)" in out
