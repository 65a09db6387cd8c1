"""A prefetcher thread (a background thread calls ``next()`` into a queue) resumes exactly (issue 25).

How many batches the thread has taken when the model trains or a save runs is a matter of timing; the rule is
not: the batches a thread other than the one that prepared the loader takes count as fetched ahead, and each
``accelerator.backward()`` trains one of them, so a save records the pass's start plus the steps trained
(``docs/lifecycle.md``). The thread here is gated, so that a timing which happens in real runs (the thread slow at
the first step, then two batches ahead during the next) happens every time.
"""

from __future__ import annotations

import queue
import threading

import pytest

from test_put_back import EPOCHS, check_resume_is_exact
from lifecycle_programs import prefetched

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def gated_thread(extra):
    """A prefetcher thread that takes one batch when the queue is empty and ``extra(step)`` more while the
    loop trains step ``step``."""
    def loop(run, save_after=None, folder=None):
        for _ in range(run.dl.epoch, EPOCHS):
            it, batches, end = iter(run.dl), queue.Queue(), object()
            asked, fetched, done = threading.Semaphore(0), threading.Semaphore(0), threading.Event()

            def fill():
                while True:
                    asked.acquire()
                    batch = next(it, end)
                    batches.put(batch)
                    if batch is end:
                        done.set()
                    fetched.release()
                    if batch is end:
                        return

            def fetch(count):
                for _ in range(count):
                    if done.is_set():
                        return
                    asked.release()
                    fetched.acquire()

            thread = threading.Thread(target=fill, daemon=True)
            thread.start()
            step = 0
            while True:
                if batches.empty():
                    fetch(1)
                batch = batches.get()
                if batch is end:
                    break
                fetch(extra(step))
                run.train(batch)
                step += 1
                if len(run.trained) == save_after:
                    run.acc.save_state(folder)
    return loop


def free_thread(depth):
    """A prefetcher thread as users write it: ``next()`` into a ``queue.Queue(maxsize=depth)``, a sentinel at the
    epoch's end; the loop trains one batch a step from the queue."""
    def loop(run, save_after=None, folder=None):
        for _ in range(run.dl.epoch, EPOCHS):
            for batch in prefetched(run.dl, depth):
                run.train(batch)
                if len(run.trained) == save_after:
                    run.acc.save_state(folder)
    return loop


@pytest.mark.parametrize("save_after", [2, 3, 6], ids=lambda k: f"after-{k}")
def test_a_prefetcher_thread_two_batches_ahead_saved_mid_epoch_resumes_with_the_batches_it_took(tmp_path, save_after):
    check_resume_is_exact(tmp_path, gated_thread(lambda step: 1 if step in (1, 5) else 0), save_after)


def test_a_prefetcher_thread_that_read_its_epoch_to_the_end_puts_back_what_was_not_trained(tmp_path):
    check_resume_is_exact(tmp_path, gated_thread(lambda step: 5 if step == 0 else 0), 3)


@pytest.mark.parametrize("save_after", [1, 4, 5, 7], ids=lambda k: f"after-{k}")
def test_a_free_running_prefetcher_thread_of_depth_2_resumes_exactly(tmp_path, save_after):
    check_resume_is_exact(tmp_path, free_thread(2), save_after)


def test_a_prefetcher_thread_trained_without_accelerator_backward_is_said_at_the_save(tmp_path, caplog):
    from test_put_back import Run

    run = Run()
    original = run.acc.backward
    run.acc.backward = lambda loss: loss.backward()  # a loop that calls loss.backward() itself
    gated_thread(lambda step: 0)(run, save_after=2, folder=tmp_path / "ckpt")
    run.acc.backward = original
    assert "Call accelerator.backward(loss) instead of loss.backward()" in caplog.text
