"""A pass whose iterator only a kept exception's traceback still holds is live at the save, and the save says so.

The program dropped its iterator (the function that made it returned), but an exception it kept
(``self.last_error = exc``) holds that function's frame, and the frame the iterator: the checkpoint records the
pass as live and the resume continues it, where the uninterrupted run's next ``iter()`` starts the next epoch.
No rule can read the program's intent here (a loop that keeps its iterator on purpose looks the same), so the
save warns, naming the variable and the function (issue 25, item 11). Loops that hold their iterator (``for``,
a generator, ``zip``) and a collected cycle save without a word.
"""

from __future__ import annotations

import logging

import pytest
import torch
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader

from accelerate_stateful import Accelerator

WARNING = "still held by"


@pytest.fixture
def setup(fresh_accelerate_state):
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = DataLoader(list(range(12)), batch_size=2)
    model, optimizer, dl = accelerator.prepare(model, optimizer, dl)
    return accelerator, model, optimizer, dl


def _train(accelerator, model, optimizer, batch) -> None:
    accelerator.backward(model(batch.float().view(-1, 1)).sum())
    optimizer.step()
    optimizer.zero_grad()


class Loop:
    """Trains two steps in a function that keeps its error in an attribute, as a loop that skips a failed step and goes on does."""

    def __init__(self, setup) -> None:
        self.accelerator, self.model, self.optimizer, self.dl = setup
        self.last_error = None

    def steps(self) -> None:
        it = iter(self.dl)
        for _ in range(2):
            _train(self.accelerator, self.model, self.optimizer, next(it))
        try:
            raise RuntimeError("a step that failed and was skipped")
        except RuntimeError as exc:
            self.last_error = exc  # its traceback holds this frame, and the frame `it`


def test_a_save_names_the_variable_and_function_of_an_iterator_a_kept_traceback_holds(setup, tmp_path, caplog):
    loop = Loop(setup)
    loop.steps()
    with caplog.at_level(logging.WARNING):
        loop.accelerator.save_state(str(tmp_path / "ckpt"))
    held = [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]
    assert len(held) == 1, caplog.text
    assert "the variable `it` of steps()" in held[0] and "loader 0's pass is live" in held[0]
    assert "drop the exception (or its __traceback__)" in held[0]


def test_dropping_the_kept_exception_before_the_save_ends_the_pass_silently(setup, tmp_path, caplog):
    loop = Loop(setup)
    loop.steps()
    loop.last_error = None
    with caplog.at_level(logging.WARNING):
        loop.accelerator.save_state(str(tmp_path / "ckpt"))
    assert WARNING not in caplog.text
    assert loop.dl.state_dict()["epoch"] == 1  # trained and let go: its epoch ended


def test_loops_that_hold_their_iterator_save_without_a_warning(setup, tmp_path, caplog):
    accelerator, model, optimizer, dl = setup

    def batches():  # a generator that wraps the loader: its frame holds the iterator on purpose
        yield from dl

    with caplog.at_level(logging.WARNING):
        for step, batch in enumerate(dl):  # the running frame holds the iterator
            _train(accelerator, model, optimizer, batch)
            if step == 1:
                accelerator.save_state(str(tmp_path / "for"))
                break
        wrapped = batches()
        _train(accelerator, model, optimizer, next(wrapped))
        accelerator.save_state(str(tmp_path / "generator"))
        for a, b in zip(dl, range(1)):  # zip holds the iterator
            _train(accelerator, model, optimizer, a)
            accelerator.save_state(str(tmp_path / "zip"))
    assert WARNING not in caplog.text


def _frames_of_a_waiting_thread():
    """A thread whose frame holds a buffer exported from a ``BytesIO``, as a ``multiprocessing`` queue's feeder
    thread holds the last message it pickled (``ForkingPickler.dumps`` returns ``BytesIO.getbuffer()``)."""
    import io
    import threading

    go = threading.Event()

    def feeder():
        view = io.BytesIO(b"pickled message").getbuffer()  # noqa: F841: the frame keeps it while waiting
        go.wait()

    thread = threading.Thread(target=feeder)
    thread.start()
    return go, thread


@pytest.mark.parametrize("holder", ["running frame", "list", "kept traceback"])
def test_the_query_leaves_no_garbage_behind(holder):
    """The query touches frame objects of every thread; a cycle keeping them would outlive those frames
    (regression: its list of frames held its own frame, and CPython 3.12 then crashed in a collection)."""
    import gc

    from accelerate_stateful.loaders import _holders

    def kept(it):
        try:
            raise RuntimeError("kept")
        except RuntimeError as exc:
            return exc  # its traceback holds this frame, and the frame `it`

    it = iter(range(3))
    keep = [it] if holder == "list" else kept(it) if holder == "kept traceback" else None
    go, thread = _frames_of_a_waiting_thread()
    gc.collect()
    gc.disable()
    try:
        answer = _holders.kept_by_a_traceback(it)
        go.set()
        thread.join()
        assert gc.collect() == 0  # nothing the query touched became garbage
    finally:
        gc.enable()
    assert (answer is not None) == (holder == "kept traceback"), answer
    del keep


def test_a_collection_after_the_query_does_not_crash_the_process():
    """The crash itself, in a process of its own: a feeder-like thread ends after the query, then a collection
    ran (before the fix: "deallocated BytesIO object has exported buffers", then a segmentation fault)."""
    import subprocess
    import sys
    import textwrap

    program = textwrap.dedent("""
        import gc, io, threading
        from accelerate_stateful.loaders import _holders

        go = threading.Event()
        def feeder():
            view = io.BytesIO(b"pickled message").getbuffer()
            go.wait()
        thread = threading.Thread(target=feeder)
        thread.start()
        gc.disable()
        _holders.kept_by_a_traceback(iter([1, 2, 3]))
        go.set()
        thread.join()
        print("collected", gc.collect())
    """)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "collected 0" in done.stdout, done.stderr[-2000:]
