"""The pure position arithmetic, exhaustively."""

from __future__ import annotations

import itertools

import pytest
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler, SequentialSampler

from accelerate_stateful import ShardPlan


def _layouts():
    for n, batch, world in itertools.product(range(0, 26), range(1, 6), range(1, 5)):
        for drop, even, split in itertools.product([False, True], repeat=3):
            if not (split and batch % world):
                yield n, batch, world, drop, even, split


def test_plan_reproduces_accelerates_batch_sampler_shard_for_every_layout():
    checked = 0
    for n, batch, world, drop, even, split in _layouts():
        for rank in range(world):
            sampler = BatchSampler(SequentialSampler(range(n)), batch, drop)
            expected = list(BatchSamplerShard(sampler, world, rank, split_batches=split, even_batches=even))
            plan = ShardPlan(n, batch // world if split else batch, world, rank, drop, even)
            got = [plan.batch_positions(k) for k in range(plan.num_batches)]
            assert got == expected, (n, batch, world, rank, drop, even, split)
            checked += 1
    assert checked == 6864


@pytest.mark.parametrize("origin", [0, 3, 10])
def test_samples_consumed_and_steps_for_are_inverse_at_every_step(origin):
    for plan in _plans(origin):
        for steps in range(plan.num_batches + 1):
            assert plan.steps_for(plan.samples_consumed(steps)) == steps


def _plans(origin: int):
    """Every rank's plan of every layout whose epoch holds ``origin``."""
    for n, batch, world, drop, even, _ in _layouts():
        if origin <= n:
            yield from (ShardPlan(n, batch, world, rank, drop, even, origin=origin) for rank in range(world))


def test_every_position_is_taken_once_when_nothing_is_dropped_or_padded():
    for n, batch, world in itertools.product(range(1, 30), range(1, 5), range(1, 4)):
        taken = []
        for rank in range(world):
            plan = ShardPlan(n, batch, world, rank, drop_last=False, even_batches=False)
            taken += [p for k in range(plan.num_batches) for p in plan.batch_positions(k)]
        assert sorted(taken) == list(range(n))


def test_padding_repeats_the_start_of_the_epoch_to_complete_the_last_step():
    plans = [ShardPlan(10, 4, 2, r, drop_last=False, even_batches=True) for r in range(2)]
    assert [[p.batch_positions(k) for k in range(p.num_batches)] for p in plans] == [
        [[0, 1, 2, 3], [8, 9, 0, 1]],
        [[4, 5, 6, 7], [2, 3, 4, 5]],
    ]
    assert plans[0].padding == 6


def test_an_origin_continues_the_epoch_from_there():
    plan = ShardPlan(10, 2, 2, 1, drop_last=False, even_batches=False, origin=4)
    assert [plan.batch_positions(k) for k in range(plan.num_batches)] == [[6, 7]]
    assert plan.samples_consumed(1) == 8


def test_a_count_off_the_step_boundaries_is_refused():
    plan = ShardPlan(20, 2, 2, 0, drop_last=False, even_batches=True)
    with pytest.raises(ValueError, match="does not fall on a step boundary"):
        plan.steps_for(3)
    with pytest.raises(ValueError, match="outside"):
        plan.steps_for(21)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        pytest.param({"batch_size": 0}, "batch_size must be at least 1", id="zero-batch"),
        pytest.param({"rank": 2}, "outside world_size", id="rank-outside"),
        pytest.param({"origin": 11}, "outside the epoch", id="origin-outside"),
    ],
)
def test_an_impossible_plan_is_refused(kwargs, match):
    base = {"num_samples": 10, "batch_size": 2, "world_size": 2, "rank": 0, "drop_last": False,
            "even_batches": True}
    with pytest.raises(ValueError, match=match):
        ShardPlan(**{**base, **kwargs})


@pytest.mark.parametrize("origin", [0, 3, 10])
def test_strided_run_counts_the_whole_evenly_spaced_batches_from_each_step(origin):
    for plan in _plans(origin):
        n, batch = plan.num_samples, plan.batch_size
        for step in range(plan.num_batches + 1):
            run = 0
            if step < plan.num_batches:
                first, _ = plan.batch_span(step)
                while step + run < plan.num_batches:
                    start = first + run * plan.total_batch_size
                    if plan.batch_span(step + run) != (start, start + batch) or start + batch > n:
                        break
                    run += 1
            assert plan.strided_run(step) == run, (plan, step)
