"""Batches handed out after the last training step are put back at a save (issue 25, item 12).

A look-ahead prefetcher (``nxt = next(it)``, then train on the previous batch) or a save at the top of a step
has taken batches the model was not trained on yet when ``save_state()`` runs. The uninterrupted run trains
them next; the resumed run must too. Each loop runs uninterrupted with one save, then a fresh process-like run
loads that checkpoint and runs the same loop: its trained batches (and final weights) must be exactly the
uninterrupted run's after the save.
"""

from __future__ import annotations

import logging
from collections import deque

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader, IterableDataset

from accelerate_stateful import Accelerator, DistContext, ShardDataLoader

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

EPOCHS = 2
N, BS = 10, 2  # 5 batches an epoch


class Run:
    """Fresh objects, as a new process has them; ``load`` resumes from a checkpoint first."""

    def __init__(self, load=None, accumulation=1, workers=0, batch_sampler=False) -> None:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        self.acc = Accelerator(cpu=True, gradient_accumulation_steps=accumulation,
                               dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
        torch.manual_seed(0)
        data = torch.arange(float(N)).unsqueeze(1)
        generator = torch.Generator().manual_seed(5)
        if batch_sampler:
            sampler = torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(data, generator=generator), BS,
                                                    drop_last=False)
            dl = DataLoader(data, batch_sampler=sampler, num_workers=workers)
        else:
            dl = DataLoader(data, batch_size=BS, shuffle=True, generator=generator, num_workers=workers)
        model, optimizer = torch.nn.Linear(1, 1), None
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        self.model, self.optimizer, self.dl = self.acc.prepare(model, optimizer, dl)
        self.trained: list = []
        if load is not None:
            self.acc.load_state(load)

    def train(self, batch) -> None:
        with self.acc.accumulate(self.model):
            self.acc.backward(self.model(batch).square().mean())
            self.optimizer.step()
            self.optimizer.zero_grad()
        self.trained.append(batch.flatten().tolist())

    def outcome(self) -> tuple:
        return self.trained, [p.detach().clone().tolist() for p in self.model.parameters()]


def prefetching(depth):
    """An apex-style prefetcher: ``depth`` batches fetched ahead of the one trained on."""
    def loop(run, save_after=None, folder=None):
        for _ in range(run.dl.epoch, EPOCHS):
            it = iter(run.dl)
            queue = deque(b for _, b in zip(range(depth), it))
            while queue:
                batch = queue.popleft()
                nxt = next(it, None)
                if nxt is not None:
                    queue.append(nxt)
                run.train(batch)
                if len(run.trained) == save_after:
                    run.acc.save_state(folder)
    return loop


def saving_at_the_top(run, save_after=None, folder=None):
    """A save at the top of a step: after ``next()``, before the batch is trained on."""
    for _ in range(run.dl.epoch, EPOCHS):
        for batch in run.dl:
            if len(run.trained) == save_after:
                run.acc.save_state(folder)
            run.train(batch)


def check_resume_is_exact(tmp_path, loop, save_after, **settings):
    uninterrupted = Run(**settings)
    loop(uninterrupted, save_after, tmp_path / "ckpt")
    reference, weights = uninterrupted.outcome()
    resumed = Run(load=tmp_path / "ckpt", **settings)
    loop(resumed)
    trained, resumed_weights = resumed.outcome()
    assert trained == reference[save_after:]
    assert resumed_weights == weights


@pytest.mark.parametrize("depth", [1, 2], ids=["depth-1", "depth-2"])
@pytest.mark.parametrize("save_after", [1, 2, 6], ids=lambda k: f"after-{k}")
def test_a_prefetcher_saved_mid_epoch_resumes_with_the_batches_it_fetched_ahead(tmp_path, depth, save_after):
    check_resume_is_exact(tmp_path, prefetching(depth), save_after)


@pytest.mark.parametrize("depth", [1, 2], ids=["depth-1", "depth-2"])
def test_a_prefetched_epoch_last_batch_is_put_back_and_the_resume_stays_in_that_epoch(tmp_path, depth):
    check_resume_is_exact(tmp_path, prefetching(depth), N // BS - depth)  # the queue holds the epoch's end


@pytest.mark.parametrize("save_after", [2, 5, 7], ids=["mid-epoch", "first-of-next-epoch", "later"])
def test_a_save_at_the_top_of_a_step_resumes_with_the_batch_of_that_step(tmp_path, save_after):
    check_resume_is_exact(tmp_path, saving_at_the_top, save_after)


@pytest.mark.parametrize("save_after", [1, 2, 3], ids=lambda k: f"after-{k}")
def test_a_prefetcher_with_accumulation_resumes_exactly_inside_and_at_the_end_of_a_window(tmp_path, save_after):
    check_resume_is_exact(tmp_path, prefetching(1), save_after, accumulation=2)


def test_a_prefetcher_over_two_workers_resumes_exactly(tmp_path):
    check_resume_is_exact(tmp_path, prefetching(1), 3, workers=2)


def test_a_prefetcher_over_a_users_batch_sampler_resumes_exactly(tmp_path):
    check_resume_is_exact(tmp_path, prefetching(2), 3, batch_sampler=True)


def test_a_resumed_top_of_step_save_puts_back_again(tmp_path):
    """The resumed run saves at the same top of a step: its checkpoint is the one it resumed from, again."""
    uninterrupted = Run()
    saving_at_the_top(uninterrupted, 5, tmp_path / "first")
    reference = uninterrupted.outcome()
    resumed = Run(load=tmp_path / "first")
    saving_at_the_top(resumed, 0, tmp_path / "second")
    again = Run(load=tmp_path / "second")
    saving_at_the_top(again)
    assert again.outcome() == (reference[0][5:], reference[1])


def two_a_step(run, save_after=None, folder=None):
    """A step trains on two batches of the same loader at once (fetched, then trained together)."""
    for _ in range(run.dl.epoch, EPOCHS):
        it = iter(run.dl)
        for first in it:
            second = next(it, None)
            run.train(first if second is None else torch.cat([first, second]))
            if len(run.trained) == save_after:
                run.acc.save_state(folder)


def test_a_loop_that_trains_on_several_batches_a_step_puts_nothing_back_after_its_second_step(tmp_path):
    check_resume_is_exact(tmp_path, two_a_step, 2)


def test_a_first_step_that_took_several_batches_is_read_as_a_look_ahead_and_the_save_says_so(tmp_path, caplog):
    run = Run()
    with caplog.at_level(logging.WARNING, logger="accelerate_stateful"):
        two_a_step(run, 1, tmp_path / "ckpt")
    said = [r.getMessage() for r in caplog.records if "before its pass's first training step" in r.getMessage()]
    assert len(said) == 1
    assert "loader 0" in said[0] and "counts 1 of them as fetched ahead" in said[0]


class Stream(IterableDataset):
    def __iter__(self):
        yield from (torch.tensor([float(i)]) for i in range(N))


def test_a_loader_that_cannot_go_back_says_how_many_batches_it_counts_as_trained(tmp_path, caplog):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, dl = acc.prepare(model, optimizer, DataLoader(Stream(), batch_size=BS))
    it = iter(dl)
    batch, nxt = next(it), next(it)
    acc.backward(model(batch).sum())
    optimizer.step()
    with caplog.at_level(logging.WARNING, logger="accelerate_stateful"):
        acc.save_state(tmp_path / "ckpt")
    said = [r.getMessage() for r in caplog.records if "after the last training step" in r.getMessage()]
    assert len(said) == 1
    assert "loader 0" in said[0] and "Stream" in said[0] and "handed out 1 batch(es)" in said[0]


def test_ranks_that_trained_on_different_batches_have_different_digests():
    """The put-back count is compared at the save: a rank that trained one batch fewer refuses with the others."""
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    digests = []
    for rank, train_second in ((0, True), (1, False)):
        dl = ShardDataLoader.from_dataloader(DataLoader(list(range(8)), batch_size=1), DistContext(rank, 2))
        it = iter(dl)
        next(it)
        optimizer.step()
        next(it)
        if train_second:
            optimizer.step()
        digests.append(dl._digest()[0])
        it.close()
    assert digests[0] != digests[1]


@pytest.mark.parametrize("depth", [1, 2, 3], ids=["depth-1", "depth-2", "depth-3"])
@pytest.mark.parametrize("save_after", range(1, EPOCHS * N // BS), ids=lambda k: f"after-{k}")
def test_a_prefetcher_saved_while_it_trains_the_batches_it_fetched_before_the_end_resumes_exactly(
        tmp_path, depth, save_after):
    """The iterator ends (``StopIteration``) while the queue still holds batches: a save in the epoch's last steps
    puts back the ones not trained yet, and the resumed run trains them in that epoch (issue 25, item 12)."""
    check_resume_is_exact(tmp_path, prefetching(depth), save_after)


def draining(depth):
    """A generator prefetcher: it stops asking the loader's iterator once it ended, then drains its own queue."""
    def prefetched(dl):
        it = iter(dl)
        queue = deque(b for _, b in zip(range(depth), it))
        for ahead in it:
            queue.append(ahead)
            yield queue.popleft()
        yield from queue

    def loop(run, save_after=None, folder=None):
        for _ in range(run.dl.epoch, EPOCHS):
            for batch in prefetched(run.dl):
                run.train(batch)
                if len(run.trained) == save_after:
                    run.acc.save_state(folder)
    return loop


@pytest.mark.parametrize("depth", [1, 2], ids=["depth-1", "depth-2"])
@pytest.mark.parametrize("save_after", range(1, EPOCHS * N // BS), ids=lambda k: f"after-{k}")
def test_a_generator_prefetcher_that_drains_its_queue_after_the_end_resumes_exactly(tmp_path, depth, save_after):
    """No ``next()`` after the iterator ended: the steps are counted by the training events of the pass's steps."""
    check_resume_is_exact(tmp_path, draining(depth), save_after)
