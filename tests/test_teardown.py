"""The gloo process group's worker threads are idle before it is destroyed (see ``_teardown``)."""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from accelerate_stateful import _teardown


def test_settle_returns_at_once_without_a_process_group():
    assert _teardown._gloo_threads() == []
    assert _teardown.settle(limit_s=0.5) is True


def test_settle_waits_until_the_gloo_threads_are_idle_after_a_collective(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        for _ in range(20):
            dist.all_reduce(torch.ones(1000))  # each work holds a tensor with a Python object
        # Looked for after the collectives: a worker thread names itself when it first runs, which on a loaded
        # machine can be after init_process_group has returned; a collective is done only once one has run.
        assert _teardown._watched()[0], "a gloo process group runs worker threads"
        assert _teardown.settle(limit_s=5.0) is True
    finally:
        dist.destroy_process_group()


def test_settle_watches_the_process_groups_threads_whatever_torch_names_them(tmp_path):
    """torch 2.6 (the dependency floor) leaves gloo's worker threads unnamed: there every other thread of the
    process is watched, so the rule holds there too (it found no thread to wait for before)."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        for _ in range(20):  # every worker thread has run (and, where torch names them, named itself)
            dist.all_reduce(torch.ones(1000))
        threads, counted = _teardown._watched()
        named = _teardown._gloo_threads()
        if named:
            assert threads and set(threads) <= set(named) and counted == _teardown.ALL_SWITCHES
        else:
            assert len(threads) >= 1 and counted == _teardown.VOLUNTARY, "gloo's worker threads are watched"
    finally:
        dist.destroy_process_group()
    assert _teardown._has_had_group(), "a process that had a process group keeps watching (a model may hold it)"


def test_waiting_on_every_other_thread_ends_once_a_thread_that_keeps_waking_is_still():
    """The unnamed case's wait: a thread that wakes every 2 ms (as one waiting for the GIL does) for 0.3 s holds
    it; a thread blocked for good, or spinning, does not."""
    stop, blocked = threading.Event(), threading.Event()

    def waking():
        end = time.monotonic() + 0.3
        while time.monotonic() < end:
            time.sleep(0.002)
        stop.set()

    threads = [threading.Thread(target=waking), threading.Thread(target=blocked.wait)]
    for thread in threads:
        thread.start()
    try:
        started = time.monotonic()
        watched = [task for task in _teardown._other_threads() if int(task.name) in {t.native_id for t in threads}]
        assert len(watched) == 2, "both threads are watched (neither waits in an event loop)"
        assert _teardown.wait_still(watched, _teardown.VOLUNTARY, limit_s=5.0) is True
        assert stop.is_set() and time.monotonic() - started >= 0.29
    finally:
        blocked.set()
        for thread in threads:
            thread.join()
