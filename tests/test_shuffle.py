"""Shuffled: the package's shuffle buffer, resumed exactly by reading a bounded stretch of its source again."""

from __future__ import annotations

import itertools
import json
import pickle

import pytest

from accelerate_stateful.errors import CheckpointError, UnsupportedConfigError
from accelerate_stateful.sources.packed import Packed
from accelerate_stateful.sources._recorded import settled
from accelerate_stateful.sources.shuffle import Draws, Shuffled, _BufferCursor


def resumed_at(make, cut, epoch=0):
    """The first ``cut`` items, a save through JSON, and the rest read by a new object loaded with it."""
    first = make()
    first.set_epoch(epoch)
    head = list(itertools.islice(iter(first), cut))
    saved = json.loads(json.dumps(first.state_dict()))
    again = make()
    again.set_epoch(epoch)
    again.load_state_dict(saved)
    return head + list(again), saved


CONFIGS = [(n, size, seed) for n in (0, 1, 9, 40) for size in (1, 2, 5, 17, 64) for seed in (0, 3)]


@pytest.mark.parametrize("n,size,seed", CONFIGS)
def test_every_item_comes_once_and_a_resume_at_every_item_continues_the_order(n, size, seed):
    make = lambda: Shuffled(list(range(n)), size, seed=seed)  # noqa: E731
    whole = list(make())
    assert sorted(whole) == list(range(n))
    if size == 1:
        assert whole == list(range(n)), "a buffer of one keeps the source's order"
    for cut in range(n + 1):
        assert resumed_at(make, cut)[0] == whole, f"cut after item {cut}"


def test_the_order_depends_on_the_seed_and_the_epoch_and_on_nothing_else():
    make = lambda seed: Shuffled(list(range(200)), 50, seed=seed)  # noqa: E731
    epochs = []
    for epoch in (0, 1):
        stream = make(0)
        stream.set_epoch(epoch)
        epochs.append(list(stream))
    assert epochs[0] != epochs[1] and epochs[0] == list(make(0))
    assert list(make(1)) != epochs[0]
    assert resumed_at(lambda: make(0), 77, epoch=1)[0] == epochs[1]


def test_the_draws_are_a_function_of_seed_epoch_and_count():
    a, b = Draws(5, 2), Draws(5, 2)
    assert [a(t) for t in (0, 1, 1500, 3)] == [b(t) for t in (0, 1, 1500, 3)]
    assert Draws(5, 3)(0) != a(0) and Draws(6, 2)(0) != a(0)


def test_the_saved_buffer_is_read_numbers_and_a_resume_reads_again_a_stretch_bounded_by_the_buffer():
    size, n = 16, 4000
    make = lambda: Shuffled(list(range(n)), size, seed=1)  # noqa: E731
    whole = list(make())
    for cut in (10, 1000, 3000):
        got, saved = resumed_at(make, cut)
        assert got == whole
        position = saved["position"]
        assert len(position["slots"]) == size and position["read"] == cut + size
        held = sorted(set(range(position["read"])) - set(whole[:cut]))
        assert sorted(position["slots"]) == held, "each slot names the item it holds by the items read before it"
        assert position["from_read"] <= min(held)
        assert position["from"] == (position["from_read"] or None)  # a list's position is its next index
        assert position["read"] - position["from_read"] < 20 * size  # not the run's length: what the buffer spans


def test_composes_with_packed_both_ways_and_resumes_at_every_row():
    docs = [{"input_ids": list(range(100 * i, 100 * i + i % 7))} for i in range(30)]
    makers = {
        "shuffled documents, packed": lambda: Packed(Shuffled(docs, 6, seed=2), seq_len=5, last="pad"),
        "packed rows, shuffled": lambda: Shuffled(Packed(docs, seq_len=3), 4, seed=2),
    }
    for name, make in makers.items():
        whole = [row["input_ids"].tolist() for row in make()]
        assert len(whole) > 10, name
        for cut in range(len(whole) + 1):
            got = [row["input_ids"].tolist() for row in resumed_at(make, cut)[0]]
            assert got == whole, f"{name}: cut after row {cut}"


@pytest.mark.parametrize("kwargs,match", [
    pytest.param({"buffer_size": 0}, r"buffer_size=0.*at least one item", id="empty-buffer"),
    pytest.param({"buffer_size": 4, "seed": -1}, r"seed=-1.*int >= 0", id="negative-seed"),
    pytest.param({"buffer_size": 4, "seed": None}, r"seed=None", id="no-seed"),
])
def test_settings_that_cannot_shuffle_are_refused_at_construction(kwargs, match):
    with pytest.raises(UnsupportedConfigError, match=match):
        Shuffled([1, 2], **kwargs)


def test_a_position_of_another_buffer_size_or_a_shorter_source_is_refused():
    stream = Shuffled(list(range(20)), 8)
    list(itertools.islice(iter(stream), 3))
    saved = stream.state_dict()
    smaller = Shuffled(list(range(20)), 4)
    with pytest.raises(CheckpointError, match="buffer_size=4.*resume with the buffer_size"):
        smaller.load_state_dict(saved)  # refused at the load
    damaged = Shuffled(list(range(20)), 8)
    damaged.load_state_dict({**saved, "position": {**saved["position"], "slots": [0] * 8}})
    with pytest.raises(CheckpointError, match="names items outside the stretch.*damaged"):
        list(damaged)
    shorter = Shuffled(list(range(5)), 8)
    with pytest.raises(CheckpointError, match="list of 5 items read in index order is 11"):
        shorter.load_state_dict(saved)  # the source's position after the buffer's last read is checked at the load
    old = {key: saved["position"][key] for key in ("from", "from_read", "read", "slots", "draws", "ended")}
    shorter.load_state_dict({**saved, "position": old})  # a position written before it was recorded
    with pytest.raises(CheckpointError, match="ended after 5 items.*had read 11"):
        list(shorter)


def test_two_saved_positions_share_nothing_mutable_so_the_loader_keeps_them_without_pickling():
    from accelerate_stateful.loaders._snapshot import shares_mutable_parts

    docs = [{"input_ids": [i] * (i % 5)} for i in range(200)]
    stream = Shuffled(Shuffled(Packed(docs, seq_len=3), 16, seed=1), 32, seed=2)
    items = iter(stream)
    for _ in range(3):
        list(itertools.islice(items, 40))
        assert stream.state_dict()["position"]["from"] is not None
        assert not shares_mutable_parts(stream.state_dict(), stream.state_dict())


def test_a_resume_with_another_seed_than_the_checkpoints_is_refused_naming_both_seeds():
    """The order after a resume would be another one: refused at the check and at the open, as a Mixture's."""
    from accelerate_stateful.errors import CheckpointError
    from accelerate_stateful.sources import Shuffled

    cursor = Shuffled(list(range(50)), 8, seed=3).open(None, epoch=0)
    for _ in range(12):
        next(cursor)
    position = cursor.position()
    again = Shuffled(list(range(50)), 8, seed=3)
    again.check_position(position)  # the same seed: accepted
    other = Shuffled(list(range(50)), 8, seed=4)
    for call in (other.check_position, lambda p: other.open(p, 0)):
        with pytest.raises(CheckpointError, match=r"seed=3, this one draws with seed=4.*Shuffled\(\.\.\., seed=3\)"):
            call(position)


class _Scanned(_BufferCursor):
    """The buffer as it found its oldest item before it counted the items per stretch: a scan of every slot."""

    def _oldest(self) -> int:
        return min(self._slots, default=self._read)


@pytest.mark.parametrize("n,size,seed", [(n, size, seed) for n in (0, 7, 300, 1000) for size in (1, 3, 16, 40, 129)
                                         for seed in (0, 5)])
def test_the_positions_recorded_after_every_item_are_those_a_scan_of_the_slots_gives_resumed_too(n, size, seed):
    """Counting the items held per stretch of reads finds the same oldest stretch as scanning the slots, so every
    position is the one written before (checkpoints of either resume alike); and the record a loader takes after
    a batch (``recorded()``, its slots made a tuple only when read or pickled) is that position."""
    owner = Shuffled(list(range(n)), size, seed=seed)
    for cut in (None, n // 3, n // 2 + 1):
        saved = None
        if cut is not None:  # resumed from a position written through JSON after ``cut`` items
            first = _BufferCursor(owner, 1, None)
            for _ in range(cut):
                _next_or_none(first)
            saved = json.loads(json.dumps(first.position()))
        counted, scanned = _BufferCursor(owner, 1, saved), _Scanned(owner, 1, saved)
        while True:
            got = [_next_or_none(counted), _next_or_none(scanned)]
            assert got[0] == got[1]
            position, record = counted.position(), counted.recorded()
            assert position == scanned.position()
            assert settled(record) == position and pickle.loads(pickle.dumps(record)) == position
            if got[0] is None:
                break


@pytest.mark.parametrize("n,size,seed", [(n, size, seed) for n in (0, 7, 300, 1000) for size in (1, 3, 16, 129)
                                         for seed in (0, 5)])
def test_records_read_after_the_buffer_drew_on_are_the_positions_they_were_taken_at(n, size, seed):
    """A record of the full buffer holds the draw count and replays the draws from an anchor taken at most every
    ``buffer_size`` draws: read only after the buffer drew on (past later anchors, into its end), settled or pickled,
    every record is the position of its own step, resumed too."""
    owner = Shuffled(list(range(n)), size, seed=seed)
    for cut in (None, n // 3):
        saved = None
        if cut is not None:
            first = _BufferCursor(owner, 2, None)
            for _ in range(cut):
                _next_or_none(first)
            saved = json.loads(json.dumps(first.position()))
        cursor, kept = _BufferCursor(owner, 2, saved), []
        while True:
            kept.append((cursor.position(), cursor.recorded()))
            if _next_or_none(cursor) is None:
                break
        for position, record in kept:
            assert settled(record) == position and pickle.loads(pickle.dumps(record)) == position


def _next_or_none(cursor):
    try:
        return next(cursor)
    except StopIteration:
        return None
