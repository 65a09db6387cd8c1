"""The global RNG states taken again only when they changed (``training/_rng_prints``): every take is the state
``getstate()`` / ``get_state()`` gives at that moment, and every set leaves the generators in the state set,
over random sequences of draws (Gaussians included, whose caches the raw bytes do not show), seeds, takes and
sets."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest

from accelerate_stateful.loaders._stream_rng import OwnRNG, Taken
from accelerate_stateful.training import _rng_prints
from accelerate_stateful.training._rng import global_states, preserved_globals, set_global_states


def _draw(choice: int, rng: random.Random) -> None:
    [lambda: random.random(), lambda: random.gauss(0, 1), lambda: np.random.rand(),
     lambda: np.random.standard_normal(), lambda: random.seed(rng.randrange(3)),
     lambda: np.random.seed(rng.randrange(3)), lambda: random.getrandbits(rng.randrange(1, 20_000)),
     lambda: np.random.randint(0, 10, size=rng.randrange(1, 2_000))][choice]()


def _assert_taken_now(taken: tuple) -> None:
    assert taken[1] == random.getstate()
    name, key, pos, has_gauss, gauss = np.random.get_state()
    assert taken[2][0] == name and (taken[2][1] == key).all() and tuple(taken[2][2:]) == (pos, has_gauss, gauss)


def test_the_fast_paths_are_on_where_the_suite_runs():
    """On CPython with numpy's MT19937, the probes at import found the raw states (else every take would call
    ``getstate()`` and this file would test the fallback only)."""
    assert _rng_prints._RANDOM_READABLE and _rng_prints._NUMPY_READABLE


@pytest.mark.parametrize("seed", range(8))
def test_every_take_and_set_is_exact_over_random_sequences_of_draws(seed):
    rng = random.Random(seed)
    saved: list = []
    with preserved_globals():
        for _ in range(400):
            choice = rng.randrange(11)
            if choice < 8:
                _draw(choice, rng)
            elif choice == 8:
                saved.append(global_states())
                _assert_taken_now(saved[-1])
            elif saved:
                target = rng.choice(saved)
                set_global_states(target)
                _assert_taken_now(target)
            _assert_taken_now(global_states())


def test_a_take_that_found_no_change_returns_the_same_state_and_one_after_a_draw_a_new_one():
    with preserved_globals():
        first = global_states()
        assert global_states()[1] is first[1] and global_states()[2] is first[2]
        random.random()
        assert global_states()[1] is not first[1] and global_states()[2] is first[2]
        np.random.standard_normal()  # caches a Gaussian: the next Gaussian changes the state, not the key
        cached = global_states()[2]
        assert cached[3] == 1
        np.random.standard_normal()
        assert global_states()[2][3] == 0, "a used-up cached Gaussian is seen though the key did not move"


def test_an_own_rng_swapped_in_and_out_keeps_both_streams_apart():
    """A stream's own states around each read (``OwnRNG.active``): the stream draws what it would alone, and the
    process's draws continue as if the stream had never read."""
    with preserved_globals():
        random.seed(11)
        np.random.seed(11)
        alone = [(random.random(), np.random.rand(), np.random.standard_normal()) for _ in range(6)]
        random.seed(11)
        np.random.seed(11)
        stream, theirs = OwnRNG(5), []
        mixed = []
        for _ in range(6):
            with stream.active():
                theirs.append((random.random(), np.random.standard_normal(), np.random.rand()))
            mixed.append((random.random(), np.random.rand(), np.random.standard_normal()))
        assert mixed == alone
        again = OwnRNG(5)
        with again.active():
            assert [(random.random(), np.random.standard_normal(), np.random.rand()) for _ in range(6)] == theirs


def test_a_taken_state_pickles_to_checkpoint_types_of_that_moment():
    with preserved_globals():
        random.seed(3)
        taken = Taken()
        before = random.getstate()
        random.random()
        found = pickle.loads(pickle.dumps(taken))
        assert tuple(found["random"][1]) == before[1]
