"""Generated training programs resume exactly (property test, one process; two real processes run the same
generator in ``test_lifecycle_mp.py``).

Each program (``lifecycle_programs.draw``) is run uninterrupted, saving as it goes, then resumed from some of
its checkpoints, and again from a checkpoint the resumed run wrote; every resumed trace (every batch trained
on or evaluated, the epoch it belongs to, Accelerate's ``sync_gradients``, and the final weights) must
continue the uninterrupted one exactly.
"""

from __future__ import annotations

import gc

import pytest
from accelerate.utils import DataLoaderConfiguration

from accelerate_stateful import Accelerator

import lifecycle_programs as programs

SEEDS = range(24)


@pytest.fixture(scope="module")
def accelerator():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield Accelerator(cpu=True, gradient_accumulation_steps=2,
                      dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.mark.parametrize("seed", SEEDS)
def test_a_generated_program_resumed_at_its_checkpoints_continues_exactly(accelerator, tmp_path, seed):
    program = programs.draw(seed, world=1)
    differences = programs.check(program, accelerator, tmp_path, rank=0)
    gc.collect()
    gc.freeze()  # what the first program imported lazily stays out of every later save's collection
    assert not differences, f"{program.describe()}\n" + "\n".join(differences)


def test_the_generator_draws_every_loop_shape_and_restart():
    drawn = [programs.draw(seed, world=1) for seed in SEEDS]
    assert {p.pattern for p in drawn} == {"for", "steps", "zip", "nested", "zip_longest", "chain", "prefetch",
                                              "roundrobin", "thread"}
    assert {p.restart for p in drawn} == {"epoch", "count", "own"}
    assert any(p.depth == 2 for p in drawn if p.pattern == "prefetch")
    assert any(p.depth >= 2 for p in drawn if p.pattern == "thread")
    assert any(p.top_peek for p in drawn) and any(p.prologue_peek for p in drawn)
    assert any(p.limit is not None for p in drawn) and any(p.keep_exception_rank == 0 for p in drawn)
    assert any(p.query_rank == 0 for p in drawn) and any(p.eval_top_every for p in drawn)
