"""``skip_samples`` on a stream of the composable sources (ranks simulated in one process): items of global indices
left out for good, wherever the range is given (before the epoch, after a resume, before ``load_state_dict``),
kept in the state through further resumes on other numbers of workers, processes and batch sizes, in shard mode and
under the dispatcher; items already delivered stay delivered, with a warning; refusals in the user's terms.

The mixture (``test_mixture.mixture``) yields distinct ints, so the global sequence read one item a batch by the main
process is the reference: item ``k`` of it is the item of global index ``k`` on every setup.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from accelerate_stateful import DispatchDataLoader, DistContext, IterableShardDataLoader
from accelerate_stateful.errors import CheckpointError, LifecycleError, StateMismatchError, UnsupportedConfigError
from accelerate_stateful.sources import Packed, Shuffled

from harness import run_loop, through_files
from test_mixture import mixture


def make(workers=0, batch=3, dispatch=False, world=1, rank=0, drop_last=False, dataset=None, persistent=False):
    dl = DataLoader(mixture() if dataset is None else dataset, batch_size=batch, num_workers=workers,
                    drop_last=drop_last, generator=torch.Generator().manual_seed(7),
                    persistent_workers=persistent)
    return (DispatchDataLoader if dispatch else IterableShardDataLoader).from_dataloader(dl, DistContext(rank, world))


def ids(steps) -> list:
    return [i for step in steps for i in step.ids]


def sequence(epoch: int) -> list:
    loader = make(0, 1)
    return [step.ids[0] for step in run_loop(loader, epoch + 1)[0] if step.epoch == epoch]


EPOCH0, EPOCH1 = sequence(0), sequence(1)


def without(seq: list, *ranges: tuple) -> set:
    return {item for k, item in enumerate(seq) if not any(start <= k < stop for start, stop in ranges)}


CONFIGS = [  # (workers before, workers after, batch before, batch after, dispatch, drop_last)
    (0, 0, 3, 3, False, False), (2, 2, 3, 3, False, False), (2, 0, 3, 3, True, False), (0, 3, 4, 4, True, False),
    (3, 1, 2, 2, False, False), (2, 3, 3, 5, False, True), (0, 2, 4, 2, True, True), (3, 0, 3, 3, True, True),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "w{}to{}-b{}to{}-{}{}".format(
    *c[:4], "dispatch" if c[4] else "shard", "-drop" if c[5] else ""))
def test_a_range_given_after_a_resume_is_left_out_and_stays_out(config):
    before_workers, after_workers, before_batch, after_batch, dispatch, drop_last = config
    skip = (40, 55)  # ahead of every share at the save points below
    for stop in (1, 3, 5):
        steps, state = run_loop(make(before_workers, before_batch, dispatch, drop_last=drop_last), 1, (stop, "in_loop"))
        resumed = make(after_workers, after_batch, dispatch, drop_last=drop_last)
        resumed.load_state_dict(through_files(state))
        resumed.skip_samples(*skip)
        assert resumed.skipped_samples == [(0, *skip)]
        middle, state2 = run_loop(resumed, 1, (stop + 2, "in_loop"), taken=stop)
        again = make(before_workers, before_batch, dispatch, drop_last=drop_last)  # back on the first setup
        again.load_state_dict(through_files(state2))
        assert again.skipped_samples == [(0, *skip)], "the range is kept in the state"
        rest = run_loop(again, 2, taken=stop + 2)[0]
        epoch0 = ids(steps) + ids(middle) + ids(s for s in rest if s.epoch == 0)
        assert len(epoch0) == len(set(epoch0)), f"stop {stop}: an item came twice"
        assert not set(epoch0) & without(EPOCH0) - without(EPOCH0, skip), f"stop {stop}: a skipped item came"
        if not drop_last:
            assert set(epoch0) == without(EPOCH0, skip), f"stop {stop}: an item was lost"
        epoch1 = ids(s for s in rest if s.epoch == 1)  # the next epoch: untouched by a range of epoch 0
        assert sorted(epoch1) == sorted(EPOCH1[:len(epoch1)] if drop_last else EPOCH1) or drop_last


@pytest.mark.parametrize("outer", ["mixture", "shuffled"])
@pytest.mark.parametrize("workers", [0, 2, 3])
@pytest.mark.parametrize("dispatch", [False, True], ids=["shard", "dispatcher"])
def test_a_resumed_run_with_the_range_equals_the_uninterrupted_run_with_it(workers, dispatch, outer):
    """The outermost source may be any composable one: here a mixture, or a shuffle buffer over it."""
    def source():
        return mixture() if outer == "mixture" else Shuffled(mixture(), buffer_size=8, seed=4)

    skip = (30, 47)
    sequence = [step.ids[0] for step in run_loop(make(0, 1, dataset=source()), 1)[0]]
    whole = make(workers, 3, dispatch, dataset=source())
    whole.skip_samples(*skip)
    reference = ids(run_loop(whole, 1)[0])
    assert sorted(reference) == sorted(without(sequence, skip))
    for stop in (0, 2, 4):
        steps, state = run_loop(make(workers, 3, dispatch, dataset=source()), 1, (stop, "in_loop"))
        resumed = make(workers, 3, dispatch, dataset=source())
        resumed.skip_samples(*skip)  # before the load: added to the checkpoint's
        resumed.load_state_dict(through_files(state))
        assert ids(steps) + ids(run_loop(resumed, 1, taken=stop)[0]) == reference, f"stop {stop}"


def test_ranges_of_a_later_epoch_and_several_ranges():
    loader = make(2, 3)
    loader.skip_samples(5, 9, epoch=1)
    loader.skip_samples(0, 2, epoch=1)
    loader.skip_samples(8, 12, epoch=1)  # overlaps the first: merged
    loader.skip_samples(20, 21)
    assert loader.skipped_samples == [(0, 20, 21), (1, 0, 2), (1, 5, 12)]
    steps = run_loop(loader, 2)[0]
    assert sorted(ids(s for s in steps if s.epoch == 0)) == sorted(without(EPOCH0, (20, 21)))
    assert sorted(ids(s for s in steps if s.epoch == 1)) == sorted(without(EPOCH1, (0, 2), (5, 12)))


@pytest.mark.parametrize("dispatch", [False, True], ids=["shard", "dispatcher"])
def test_persistent_workers_leave_out_a_range_given_between_epochs(dispatch):
    loader = make(2, 3, dispatch, persistent=True)
    first = ids(run_loop(loader, 1)[0])
    loader.skip_samples(10, 25)  # the epoch the loader stands at: 1, read by the same worker processes
    second = ids(s for s in run_loop(loader, 2)[0] if s.epoch == 1)
    assert sorted(first) == sorted(EPOCH0)
    assert sorted(second) == sorted(without(EPOCH1, (10, 25)))


def test_a_checkpoint_that_leaves_out_items_is_refused_by_a_loader_over_another_stream():
    loader = make(0, 3)
    loader.skip_samples(4, 8)
    _, state = run_loop(loader, 1, (2, "in_loop"))
    with pytest.raises(StateMismatchError, match="dataset class: saved 'Mixture', current 'Plain'"):
        make(0, 3, dataset=Plain()).load_state_dict(through_files(state))


def test_items_already_delivered_stay_delivered_with_a_warning(caplog):
    steps, state = run_loop(make(2, 3), 1, (4, "in_loop"))  # 12 items taken, indices below 12
    resumed = make(2, 3)
    resumed.load_state_dict(through_files(state))
    resumed.skip_samples(0, 30)
    with caplog.at_level(logging.WARNING, logger="accelerate_stateful"):
        rest = ids(run_loop(resumed, 1, taken=4)[0])
    assert "skip_samples(0, 30): 2 of 2 reader shares had already delivered items of this range" in caplog.text
    assert set(ids(steps)) | set(rest) == without(EPOCH0, (12, 30))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="accelerate_stateful"):
        run_loop(resumed, 2)  # the next epoch: said once only
    assert "reader shares had already delivered" not in caplog.text


def test_packed_rows_are_left_out_by_row_index():
    def rows_of(loader) -> list:
        return [tuple(row) for batch in loader for row in batch["input_ids"].tolist()]

    rows = rows_of(make(0, 1, dataset=Packed(mixture_of_documents(), seq_len=4)))
    for workers in (0, 2):
        loader = make(workers, 2, dataset=Packed(mixture_of_documents(), seq_len=4))
        loader.skip_samples(3, 6)
        assert sorted(rows_of(loader)) == sorted(row for k, row in enumerate(rows) if not 3 <= k < 6)


def test_the_mixture_counts_a_skipped_item_as_drawn_not_delivered():
    loader = make(0, 3)
    loader.skip_samples(0, 10)
    steps, state = run_loop(loader, 1, (8, "in_loop"))
    delivered, drawn = mixture().delivered(state), sum(_drawn(state).values())
    assert sum(delivered.values()) == len(ids(steps)) == 24 and drawn == 34


@pytest.mark.parametrize("dispatch", [False, True], ids=["shard", "dispatcher"])
def test_every_rank_leaves_out_the_same_items_on_another_number_of_processes(dispatch):
    skip = (25, 40)
    before, states = [], {}
    for rank in range(2):
        steps, states[rank] = run_loop(make(2, 3, dispatch, 2, rank), 1, (2, "in_loop"))
        before += ids(steps)
    after = []
    for rank in range(3):
        loader = make(0, 3, dispatch, 3, rank)
        loader.load_state_dict(through_files(states[rank if rank < 2 else 0], rank if rank < 2 else 0))
        loader.skip_samples(*skip)
        after += ids(run_loop(loader, 1)[0])
    assert not set(after) & (set(EPOCH0) - without(EPOCH0, skip))
    assert set(before) | set(after) == without(EPOCH0, skip) | (set(before) & set(EPOCH0))


class Plain(IterableDataset):
    def __iter__(self):
        return iter(range(10))


def test_refusals_in_the_users_terms():
    loader = make(0, 3)
    for bad, words in [((3, 3), "0 <= start < stop"), ((-1, 4), "0 <= start < stop"), ((1.5, 4), "integers")]:
        with pytest.raises(UnsupportedConfigError, match=words):
            loader.skip_samples(*bad)
    run_loop(loader, 1)
    with pytest.raises(UnsupportedConfigError, match="already in epoch 1"):
        loader.skip_samples(0, 4, epoch=0)
    passing = iter(loader)
    next(passing)
    with pytest.raises(LifecycleError, match="skip_samples"):
        loader.skip_samples(50, 60)
    del passing
    for dispatch in (False, True):
        with pytest.raises(UnsupportedConfigError, match="composable sources of accelerate_stateful.sources"):
            make(0, 3, dispatch, dataset=Plain()).skip_samples(0, 4)
    assert loader.skipped_samples == []  # nothing refused was recorded
    damaged = make(0, 3).state_dict()
    damaged["skipped_samples"] = [[0, 5, 2]]
    with pytest.raises(UnsupportedConfigError, match="invalid skipped samples"):
        make(0, 3).load_state_dict(damaged)


def test_a_damaged_source_range_is_refused():
    mix = mixture()
    with pytest.raises(CheckpointError, match="not one it wrote"):
        mix.load_state_dict({"index": 0, "position": None, "skip": [[5, 2]]})
    mix.load_state_dict({"index": 0, "position": None, "skip": [[2, 5], [7, 9]]})
    assert [x for k, x in enumerate(EPOCH0) if not (2 <= k < 5 or 7 <= k < 9)] == list(mix)


# ------------------------------------------------------------------ helpers
class Documents(IterableDataset):
    """Token lists of lengths 1..6, each token naming its document and place (``100 * doc + i``)."""

    def __init__(self) -> None:
        self.pos = 0

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]

    def __iter__(self):
        while self.pos < 40:
            self.pos += 1
            yield {"input_ids": [100 * self.pos + i for i in range(1 + self.pos % 6)]}


def mixture_of_documents():
    from accelerate_stateful.sources import Mixture

    return Mixture({"docs": Documents()}, {"docs": 1}, seed=3)


def _drawn(state) -> dict:
    from accelerate_stateful.sources._mixture_state import mixture_positions

    totals: dict = {}
    for position in mixture_positions(state):
        for name, count in position["drawn"].items():
            totals[name] = totals.get(name, 0) + count
    return totals


@pytest.mark.parametrize("workers", [0, 2, 3])
@pytest.mark.parametrize("world,batch,dispatch", [(1, 2, False), (2, 3, False), (2, 2, True), (3, 1, True)],
                         ids=["1x2-shard", "2x3-shard", "2x2-dispatcher", "3x1-dispatcher"])
def test_the_documented_recipe_leaves_out_whole_steps(workers, world, batch, dispatch):
    """docs/batch-size-and-skips.md: in an epoch read on one setup from its start, with S reader shares
    (max(num_workers, 1)) and G = total_batch_size, indices [S*G*j0, S*G*j1) are exactly steps S*j0 .. S*j1 - 1."""
    shares, j0, j1 = max(workers, 1), 1, 2
    plain = [run_loop(make(workers, batch, dispatch, world, rank), 1)[0] for rank in range(world)]
    total = plain[0] and make(workers, batch, dispatch, world, 0).total_batch_size
    for rank in range(world):
        loader = make(workers, batch, dispatch, world, rank)
        loader.skip_samples(shares * total * j0, shares * total * j1)
        got = [step.ids for step in run_loop(loader, 1)[0]]
        full = [step.ids for step in plain[rank]]
        left_out = full[shares * j0: shares * j1]
        expected = full[: shares * j0] + full[shares * j1:]
        assert got[: len(expected) - shares] == expected[: len(expected) - shares], f"rank {rank}"
        assert not {i for step in left_out for i in step} & {i for step in got for i in step}


@pytest.mark.parametrize("dispatch", [False, True], ids=["shard", "dispatcher"])
def test_the_resume_line_and_inspect_name_the_items_left_out(dispatch, caplog):
    from pathlib import Path

    from accelerate_stateful.checkpoint._lines import log_resume as _log_resume
    from accelerate_stateful.cli._report import _rank, format_report

    _, state = run_loop(make(2, 3, dispatch, 2, 0), 1, (2, "in_loop"))
    loader = make(2, 3, dispatch, 2, 0)
    loader.skip_samples(30, 36)  # before the load: added to the checkpoint's
    loader.load_state_dict(through_files(state))
    with caplog.at_level("INFO", logger="accelerate_stateful"):
        _log_resume(0, loader, state, Path("ckpt"))
    assert "leaving out samples [30, 36) of epoch 0, from ckpt" in caplog.text
    saved = through_files(loader.state_dict())
    row = _rank(None, 0, [saved], 0)
    assert row["skipped_samples"] == [[0, 30, 36]]
    report = {"checkpoint": "ckpt", "problems": [], "gradient_carry": None, "complete": True, "world_size": 2,
              "num_loaders": 1, "manifest_problem": None, "manifest_version": 1,
              "loaders": [{"loader": 0, "kind": saved["mode"], "reads": None, "format_version": 1, "config": {},
                           "ranks": [row]}]}
    assert "skipped samples (skip_samples): [30, 36) of epoch 0" in format_report(report)
