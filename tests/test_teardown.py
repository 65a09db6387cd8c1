"""The gloo process group's worker threads are idle before it is destroyed (see ``_teardown``)."""

from __future__ import annotations

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
        assert _teardown._gloo_threads(), "a gloo process group runs worker threads"
        assert _teardown.settle(limit_s=5.0) is True
    finally:
        dist.destroy_process_group()
