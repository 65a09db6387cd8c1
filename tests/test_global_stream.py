"""The global-sequence base of the composable sources: the Stateful contract and the split between workers."""

from __future__ import annotations

import itertools

import pytest
from torch.utils.data import DataLoader

from accelerate_stateful.errors import CheckpointError, UnsupportedConfigError
from accelerate_stateful.sources._global import GlobalStream, open_source


class Squares(GlobalStream):
    """Items (epoch, k * k) for k below ``n``, read through a child cursor over ``range(n)``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def open(self, position, epoch):
        child = open_source(list(range(self.n)), position, epoch)

        class _Cursor:
            def __next__(self):
                k = next(child)
                return (epoch, k * k)

            def position(self):
                return child.position()

        return _Cursor()


def test_state_round_trip_at_every_point():
    full = list(Squares(7))
    for cut in range(8):
        stream = Squares(7)
        items = iter(stream)
        head = list(itertools.islice(items, cut))
        saved = stream.state_dict()
        again = Squares(7)
        again.load_state_dict(saved)
        assert head + list(again) == full
        assert list(again) == full, "an iter() with nothing loaded starts the sequence again"


def test_epoch_reaches_the_cursor_and_an_unloaded_state_is_the_start():
    stream = Squares(3)
    assert stream.state_dict() == {"index": 0, "position": None}
    stream.set_epoch(4)
    assert [e for e, _ in stream] == [4, 4, 4]


@pytest.mark.parametrize("workers", [2, 3])
def test_workers_split_the_sequence_and_each_share_resumes_its_own_items(workers):
    n = 11
    whole = [k * k for k in range(n)]
    loader = DataLoader(Squares(n), batch_size=None, num_workers=workers)
    got = [int(sq) for _, sq in loader]
    assert sorted(got) == sorted(whole) and len(got) == n
    # share w holds the items k % workers == w, in order, and a position between them names the next one
    for w in range(workers):
        share = [whole[k] for k in range(w, n, workers)]
        assert [x for x in got if x in share] == share


def test_a_foreign_state_and_an_opaque_child_are_refused_in_plain_words():
    with pytest.raises(CheckpointError, match="not one it wrote"):
        Squares(3).load_state_dict({"samples": 3})

    class Opaque(GlobalStream):
        def open(self, position, epoch):
            return open_source(iter(range(3)), position, epoch)

    with pytest.raises(UnsupportedConfigError, match="no state_dict"):
        list(Opaque())
