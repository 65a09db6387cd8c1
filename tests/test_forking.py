"""Which interpreters can fork a DataLoader worker safely in a distributed run (CPython gh-112275), and the
warning a loader gives on the others (``loaders/_forking.py``, docs/reliability.md)."""

from __future__ import annotations

import logging
import multiprocessing
import sys

import pytest
import torch
from torch.utils.data import DataLoader

from accelerate_stateful.loaders import _forking

FIRST_FIXED = {(3, 8): 20, (3, 9): 20, (3, 10): 15, (3, 11): 10}


@pytest.mark.parametrize("minor", range(6, 16))
def test_every_release_is_judged_by_whether_it_carries_the_fix(minor):
    for micro in range(0, 30):
        carries_fix = minor >= 12 or micro >= FIRST_FIXED.get((3, minor), 10**6)
        assert _forking.fork_is_safe((3, minor, micro)) is carries_fix, (3, minor, micro)


def test_the_suite_runs_on_an_interpreter_free_of_the_fork_bug():
    # The Makefile picks such an interpreter; on another, the scenario launches lose workers at their start.
    assert _forking.fork_is_safe(tuple(sys.version_info[:3])), (
        f"Python {sys.version.split()[0]} has CPython bug gh-112275; run `make test` (it picks Python 3.12 or "
        "later where one is installed) or `make test PYTHON=/path/to/python3.12`"
    )


def _loader(workers: int, context=None) -> DataLoader:
    return DataLoader(torch.arange(8), batch_size=2, num_workers=workers,
                      multiprocessing_context=context if workers else None)  # torch refuses a context without workers


AFFECTED = (3, 11, 7)


@pytest.mark.parametrize("context", [None, "fork", multiprocessing.get_context("fork")])
def test_a_loader_forking_workers_in_a_distributed_run_on_an_affected_interpreter_warns_once(
        context, caplog, monkeypatch):
    monkeypatch.setattr(_forking, "_warned", False)
    if context is None:  # the platform's default: fork on Linux before Python 3.14
        fork = multiprocessing.get_context("fork")
        monkeypatch.setattr(multiprocessing, "get_context", lambda method=None: fork)
    with caplog.at_level(logging.WARNING, logger=_forking.__name__):
        assert _forking.warn_if_unsafe(_loader(2, context), world_size=2, version=AFFECTED)
        assert _forking.warn_if_unsafe(_loader(1, context), world_size=4, version=AFFECTED)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1
    assert "gh-112275" in messages[0] and "3.11.7" in messages[0] and "Python 3.12" in messages[0]
    assert "forkserver" in messages[0]


@pytest.mark.parametrize("workers, world, context, version", [
    (0, 2, "fork", AFFECTED),  # no worker is forked
    (2, 1, "fork", AFFECTED),  # no process group whose threads attach
    (2, 2, "forkserver", AFFECTED),  # workers forked by a single-threaded server
    (2, 2, "spawn", AFFECTED),
    (2, 2, "fork", (3, 11, 10)),
    (2, 2, "fork", (3, 12, 0)),
    (2, 8, "fork", (3, 13, 0)),
])
def test_no_warning_where_no_worker_is_forked_from_a_rank_on_an_affected_interpreter(
        workers, world, context, version, caplog, monkeypatch):
    monkeypatch.setattr(_forking, "_warned", False)
    with caplog.at_level(logging.WARNING, logger=_forking.__name__):
        assert not _forking.warn_if_unsafe(_loader(workers, context), world_size=world, version=version)
    assert not caplog.records
