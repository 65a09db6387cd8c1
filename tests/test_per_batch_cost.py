"""What a batch costs in this package's own code, counted in Python calls (noise-free, unlike a timing).

Issue 28 §5: a prepared shuffled map-style loader with 0 workers cost 1.04-1.08x a bare ``DataLoader`` after the
lifecycle bookkeeping grew to 26 calls of this package per batch. No timing is asserted anywhere (the machine is
shared); a bound on the calls per batch catches the same growth, and ``docs/benchmarks.md`` section A has the
figures measured side by side.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import re

import pytest
import torch
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader

import accelerate_stateful
from accelerate_stateful import Accelerator

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state", "fresh_clock")


@pytest.fixture
def fresh_clock(monkeypatch):
    """The program-order clock as a fresh program has it: no pass current. A pass another test of this process
    left live (its iterator still referenced) stays current, and then every batch here also looks at it, one call
    more (``_training._others_handed_out``), as a real program with two live loops does."""
    from accelerate_stateful.training import _training

    monkeypatch.setattr(_training, "_current", [])

PACKAGE = os.path.dirname(accelerate_stateful.__file__)
BATCHES = 64


def own_calls_per_batch(loader, step=None) -> float:
    """Calls of functions in this package per batch, over ``BATCHES`` batches after the first (``step(batch)``:
    the loop's training work, its own calls included)."""
    iterator = iter(loader)
    next(iterator)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(BATCHES):
        batch = next(iterator)
        if step is not None:
            step(batch)
    profile.disable()
    stats = pstats.Stats(profile).stats
    return sum(calls for (path, _, _), (_, calls, *_) in stats.items() if path.startswith(PACKAGE)) / BATCHES


def prepared(**loader_kw):
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    generator = torch.Generator().manual_seed(0)
    dl = DataLoader(list(range(4096)), batch_size=32, shuffle=True, generator=generator, **loader_kw)
    return accelerator, accelerator.prepare(dl)


# The handle's next() (which takes the batch: a prefetcher thread's next() takes it under the loader's lock, the
# training thread's needs no lock), its record, the program-order clock, GradientState's active loader, the pass's
# generator, the pipeline's fetch scope, the base iterator's batches read without torch's profiler annotation
# (``_torch_iter``: one call that saves torch's two dispatched operator calls), the sampler, the position's
# arithmetic, the device placement: 10 calls, and the sampler's next chunk of index lists once every 64 batches
# here (2,048 samples).
PER_BATCH = 10 + 0.1


def test_a_shuffled_map_style_batch_costs_ten_calls_of_this_package():
    _, dl = prepared()
    assert own_calls_per_batch(dl) <= PER_BATCH


def test_a_training_step_adds_only_the_training_events_to_a_batchs_calls():
    # Each training event (accelerator.backward, optimizer.step, one per parameter's gradient) is one call of
    # _training.note_trained; accelerator.backward adds its own frame.
    accelerator, dl = prepared()
    model = torch.nn.Linear(32, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)

    def step(batch):
        loss = model(batch.float().reshape(1, -1)).sum()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    events = 1 + 1 + len(list(model.parameters()))  # backward, optimizer.step, each parameter's hook
    assert own_calls_per_batch(dl, step) <= PER_BATCH + events + 1


def test_the_side_by_side_benchmark_runs_and_reports_the_three_loaders(monkeypatch, capsys):
    """benchmarks/bench_per_batch.py keeps working (tiny sizes; no timing is checked)."""
    import runpy
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_per_batch.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--batches", "5", "--rounds", "2"])
    runpy.run_path(str(script), run_name="__main__")
    assert re.search(r"bare [\d.]+ us/batch, bare unannotated [\d.]+ us/batch, ours [\d.]+ us/batch, ours/bare "
                     r"median of the rounds [\d.]+, ours/bare unannotated [\d.]+",
                     capsys.readouterr().out)
