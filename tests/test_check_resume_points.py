"""``check-resume --at`` with named moments (``cli/_kill_points.py``) and the records they are found in."""

from __future__ import annotations

import argparse
import json

import pytest

from accelerate_stateful.cli._kill_points import Point, points, resolve
from accelerate_stateful.training import _record_switch


def _step(n: int, epoch: int, losses: int = 1) -> dict:
    return {"event": "step", "step": n, "epoch": epoch, "losses": [0.5] * losses}


RUN = {0: [{"event": "start"}, _step(1, 0), {"event": "saving", "step": 1}, _step(2, 0), _step(3, 1, losses=2),
           {"event": "eval", "step": 3}, _step(4, 1)]}


def test_named_moments_are_found_in_the_uninterrupted_runs_records_and_sorted_with_steps():
    found, missing = resolve(points("eval,first-batch,epoch-end,2,mid-accumulation,save"), RUN)
    assert missing == []
    assert [(p.name, p.event, p.step) for p in found] == [
        ("save", "saving", 1), ("2", "step", 2), ("epoch-end", "step", 2), ("mid-accumulation", "backward", 2),
        ("first-batch", "step", 3), ("eval", "eval", 3)]
    assert found[3].describe() == "mid-accumulation (the first backward of step 3)"
    assert found[3].reached({"event": "backward", "step": 3, "n": 1})
    assert not found[3].reached({"event": "backward", "step": 3, "n": 2})


def test_a_moment_the_uninterrupted_run_never_reaches_is_reported_not_dropped():
    one_epoch = {0: [_step(1, 0), _step(2, 0)]}
    found, missing = resolve(points("epoch-end,first-batch,eval,mid-accumulation,save,1"), one_epoch)
    assert found == [Point("1", "step", 1)]
    assert missing == ["epoch-end", "first-batch", "eval", "mid-accumulation", "save"]


def test_a_kill_point_that_is_neither_a_step_nor_a_moment_is_refused_listing_the_moments():
    with pytest.raises(argparse.ArgumentTypeError, match="'epoch_end': give steps .* or names of moments "
                                                         r"\(first-batch, epoch-end, mid-accumulation, eval, save\)"):
        points("3,epoch_end")


def _recorded(monkeypatch, tmp_path) -> tuple:
    """A recording Accelerator (records into ``tmp_path``) with a model, its optimizer, a training loader of two
    batches and an evaluation loader of two."""
    import torch
    from accelerate.utils import DataLoaderConfiguration
    from torch.utils.data import DataLoader

    from accelerate_stateful import Accelerator

    monkeypatch.setattr(_record_switch, "active", None)
    monkeypatch.setenv(_record_switch.RECORD_ENV, str(tmp_path))
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    model = torch.nn.Linear(1, 1)
    return (accelerator, *accelerator.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(torch.ones(4, 1), batch_size=2),
        DataLoader(torch.ones(2, 1), batch_size=1)))


def test_the_records_name_each_backward_each_evaluation_and_the_training_loaders_epoch(monkeypatch, tmp_path):
    accelerator, model, optimizer, train, evaluate = _recorded(monkeypatch, tmp_path)
    for x in train:
        for half in x.split(1):
            accelerator.backward(model(half).sum())
        optimizer.step()
    model.eval()
    for _ in evaluate:
        pass
    records = [json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    assert [(r["event"], r.get("step"), r.get("n")) for r in records if r["event"] != "start"] == [
        ("backward", 1, 1), ("backward", 1, 2), ("step", 1, None),
        ("backward", 2, 1), ("backward", 2, 2), ("step", 2, None), ("eval", 2, None)]
    assert [r["epoch"] for r in records if r["event"] == "step"] == [0, 0]


HELD_SCRIPT = """
import torch
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader
from accelerate_stateful import Accelerator

accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
model = torch.nn.Linear(1, 1)
model, optimizer, train = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                              DataLoader(torch.ones(8, 1), batch_size=2))
for i, x in enumerate(train):
    accelerator.backward(model(x).sum())
    optimizer.step()
    if i == 0:
        accelerator.save_state("ckpt")
"""


@pytest.mark.parametrize("point, held_after", [({"event": "step", "step": 2}, 2),
                                                 ({"event": "saving", "step": 1}, 1),
                                                 ({"event": "backward", "step": 2}, 2)])
def test_a_process_stops_itself_where_its_records_reach_the_kill_point_and_goes_on_when_continued(
        tmp_path, point, held_after):
    """The checker's kill lands at the point by construction: the process holds there (stopped) until signalled,
    however long the checker takes to read its records; continued, it runs to its own end."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "held.py"
    script.write_text(HELD_SCRIPT, encoding="utf-8")
    env = {**os.environ, _record_switch.RECORD_ENV: str(tmp_path / "records"),
           _record_switch.HOLD_ENV: json.dumps(point)}
    proc = subprocess.Popen([sys.executable, script], cwd=tmp_path, env=env)
    try:
        deadline = time.monotonic() + 120
        while _state(proc.pid) != "T":
            assert proc.poll() is None and time.monotonic() < deadline, "the process never stopped at the point"
            time.sleep(0.05)
        time.sleep(0.5)  # held: nothing more is recorded however long the checker waits
        lines = [json.loads(line) for line in (tmp_path / "records" / "rank0.jsonl").read_text().splitlines()]
        assert _record_switch.reaches(point, lines[-2]) and lines[-1]["event"] == "held"
        assert lines[-1]["step"] == held_after
        assert [r for r in lines[:-2] if _record_switch.reaches(point, r)] == []
        os.kill(proc.pid, signal.SIGCONT)
        assert proc.wait(timeout=120) == 0
    finally:
        proc.kill()
    steps = [json.loads(line) for line in (tmp_path / "records" / "rank0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if r["event"] == "step"] == [1, 2, 3, 4]
    assert sum(r["event"] == "held" for r in steps) == 1


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return stat[stat.rindex(b")") + 2:].split()[0].decode()


def test_evaluation_batches_are_counted_on_the_next_step_but_not_compared_with_its_training_batches(
        monkeypatch, tmp_path):
    """A run resumed from a checkpoint saved right after an evaluation does not evaluate again: the step after it
    must still compare equal, so evaluation batches stay out of the step's batches and the hash chain."""
    accelerator, model, optimizer, train, evaluate = _recorded(monkeypatch, tmp_path)
    for step, x in enumerate(train):
        if step == 1:
            model.eval()
            for _ in evaluate:
                pass
            model.train()
        accelerator.backward(model(x).sum())
        optimizer.step()
    steps = [json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    steps = [r for r in steps if r["event"] == "step"]
    assert [len(r["batches"]) for r in steps] == [1, 1]
    assert [r.get("evaluation_batches") for r in steps] == [None, 2]
    assert steps[1]["chain"] != steps[0]["chain"]
