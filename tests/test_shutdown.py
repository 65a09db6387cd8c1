"""Clean shutdown: no data-loading worker outlives its loader, and a failing rank ends the whole job.

Worker processes are children of this process (the default fork context), so
they are found by listing this process's children with psutil (those there
before the test are left out); zombies count as gone.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader

from accelerate_stateful import Accelerator, DistContext, ShardDataLoader
import mp_harness
from scripts import load_script

ROOT = Path(__file__).resolve().parent.parent
WORKERS = 2
GONE_WITHIN_S = 15  # a worker checks every 5 s whether its parent is still alive


pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def live_children(ignore: frozenset = frozenset()) -> list[psutil.Process]:
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.pid not in ignore and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


class Children:
    """This process's children that were not there when the test began."""

    def __init__(self) -> None:
        self.before = frozenset(p.pid for p in live_children())

    def live(self) -> list[psutil.Process]:
        return live_children(self.before)

    def left_after(self, timeout: float = GONE_WITHIN_S) -> list[psutil.Process]:
        deadline = time.monotonic() + timeout
        while self.live() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.live()


@pytest.fixture
def children() -> Children:
    return Children()


def prepared(persistent: bool = False, n: int = 64, dispatch: bool = False):
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True,
                                                                                  dispatch_batches=dispatch))
    dl = DataLoader(list(range(n)), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0),
                    num_workers=WORKERS, persistent_workers=persistent)
    return accelerator, accelerator.prepare(dl)


# The dispatcher's workers are its reader's: they end with the dispatcher's pass, not when a later pass starts.
@pytest.mark.parametrize("dispatch", [False, True], ids=["shard", "dispatcher"])
def test_workers_of_a_loop_left_with_break_end_at_the_loaders_next_event_and_its_position_stays_readable(
        children, dispatch):
    _, dl = prepared(dispatch=dispatch)
    for _ in dl:
        assert len(children.live()) == WORKERS
        break
    gc.collect()
    # The pass waits for its verdict, and its workers hold its position: a query reads it whenever the iterator
    # object died (as torchdata's StatefulDataLoader keeps its iterator).
    assert len(children.live()) == WORKERS
    assert dl.batches_yielded == 1 and dl.state_dict()["batches_yielded"] == 1
    iter(dl)  # the loader's next event takes the verdict (a query would not: docs/lifecycle.md)
    assert children.left_after() == []
    assert dl.batches_yielded == 0  # a pass dropped without training is undone


def test_a_closed_iterator_ends_its_workers_at_once(children):
    _, dl = prepared()
    with contextlib.closing(iter(dl)) as it:
        next(it)
        assert len(children.live()) == WORKERS
    assert children.left_after() == []


def test_workers_of_a_loop_that_raised_end_at_the_loaders_next_event(children):
    _, dl = prepared()

    def train() -> None:
        for step, _ in enumerate(dl):
            if step == 2:
                raise RuntimeError("loss is NaN")

    with pytest.raises(RuntimeError, match="loss is NaN") as info:
        train()
    assert dl.state_dict()["batches_yielded"] == 3  # its position is still there to read, or to save
    iter(dl)
    assert children.left_after() == [], "the workers outlived the failed loop's verdict"
    assert info.value.__traceback__ is not None  # even while the traceback (and its frames) is still held


@pytest.mark.parametrize("persistent", [False, True], ids=["workers-per-epoch", "persistent-workers"])
def test_workers_end_when_a_prepared_loader_is_deleted_mid_epoch(children, persistent):
    accelerator, dl = prepared(persistent)
    it = iter(dl)
    next(it)
    assert len(children.live()) == WORKERS
    del it, dl, accelerator  # the Accelerator holds its prepared loaders, as Accelerate's does
    gc.collect()
    assert children.left_after() == []


def test_persistent_workers_live_between_epochs_and_end_with_the_loader(children):
    dl = ShardDataLoader.from_dataloader(
        DataLoader(list(range(16)), batch_size=4, num_workers=WORKERS, persistent_workers=True), DistContext(0, 1)
    )
    first = [b.tolist() for b in dl]
    workers = {p.pid for p in children.live()}
    second = [b.tolist() for b in dl]
    assert len(workers) == WORKERS and {p.pid for p in children.live()} == workers  # the same workers served both
    assert first == second
    del dl
    gc.collect()
    assert children.left_after() == []


# --------------------------------------------------------------------------- two real processes
def _load_demo():
    return load_script("examples/demo.py", "examples_demo")


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_rank_that_raises_mid_epoch_ends_the_whole_job_promptly(tmp_path):
    demo = _load_demo()
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(demo.free_port()), str(ROOT / "tests" / "torture_train.py"), "--out", str(out),
        "--num-workers", "1", "--epochs", "2", "--samples", "200", "--batch-size", "4", "--save-every", "4",
        "--raise-at-step", "6", "--raise-on-rank", "1",
    ]
    job = mp_harness.start(command, tmp_path / "launch")
    proc, log = job.procs[0], job.folder / "launch0.log"
    raised_at = None
    try:
        deadline = time.monotonic() + 150
        while proc.poll() is None and time.monotonic() < deadline:
            # Through the job, which tolerates a launcher already gone: a forked launcher is
            # reaped by its server at once, with no zombie left for psutil to find.
            job.descendants()
            if raised_at is None and demo.progress(out / "stream_rank1.jsonl", 0) and \
                    demo.progress(out / "stream_rank1.jsonl", 0)["step"] >= 6:
                raised_at = time.monotonic()
            time.sleep(0.05)
        code = proc.poll()
        ended = time.monotonic()
    finally:
        if proc.poll() is None:
            job.kill()
    output = log.read_text(errors="replace")
    seen = {**job.seen, **{p.pid: p for p in job.launchers}}
    assert code is not None, f"the job was still running 150 s after its start:\n{output}"
    assert raised_at is not None, f"rank 1 never reached step 6:\n{output}"
    print(f"the job ended {ended - raised_at:.1f} s after rank 1 raised, with status {code}; "
          f"{len(seen)} processes seen")
    assert code != 0 and "fails at step 6" in output
    assert ended - raised_at < 60
    cleanup = time.monotonic()
    left = [p for p in seen.values() if _alive(p)]
    while left and time.monotonic() - cleanup < GONE_WITHIN_S:
        time.sleep(0.1)
        left = [p for p in left if _alive(p)]
    assert not left, f"processes of the job outlived it: {[p.pid for p in left]}"
    print(f"every process of the job was gone {time.monotonic() - cleanup:.1f} s after it ended")


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
