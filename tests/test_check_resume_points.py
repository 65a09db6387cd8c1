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


def test_the_records_name_each_backward_each_evaluation_and_the_training_loaders_epoch(monkeypatch, tmp_path):
    import torch
    from accelerate.utils import DataLoaderConfiguration
    from torch.utils.data import DataLoader

    from accelerate_stateful import Accelerator

    monkeypatch.setattr(_record_switch, "active", None)
    monkeypatch.setenv(_record_switch.RECORD_ENV, str(tmp_path))
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    model = torch.nn.Linear(1, 1)
    model, optimizer, train, evaluate = accelerator.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(torch.ones(4, 1), batch_size=2),
        DataLoader(torch.ones(2, 1), batch_size=1))
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
