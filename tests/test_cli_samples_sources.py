"""``accelerate-stateful samples`` of a stream over a ``Mixture``: each taken step's samples as (source, document).

Every source yields ``base + i`` for its ``i``-th document (``a``: 1000.., ``b``: 2000.. a stateful iterable,
``c``: 3000..; an inner mixture's ``x``: 5000.., ``y``: 6000..), so the real loaders' batches say which source
and document each sample is. Ranks are simulated in this process. For random configurations (weights,
``Stages``/``Ramp`` schedules, seeds, 1 to 3 ranks, 0 or 2 workers, the shard loader or the dispatcher,
``split_batches``, restarts, rows left out, a mixture of mixtures) the loaders run to a save point, are
resumed from the files on another worker count and run to a second one: the tool's answers from each
checkpoint alone must equal what the real loaders yielded up to it.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from torch.utils.data import DataLoader

from accelerate_stateful import DispatchDataLoader, DistContext, IterableShardDataLoader, Mixture, Packed, Ramp, Stages
from accelerate_stateful.checkpoint import _files

from cli_run import cli_json, run_cli, save_checkpoint
from test_mixture import Counter

SOURCES = {"a": 1000, "b": 2000, "c": 3000, "inner/x": 5000, "inner/y": 6000}


def _named(item: int) -> dict:
    source = max((s for s, base in SOURCES.items() if item >= base), key=SOURCES.get)
    return {"source": source, "document": item - SOURCES[source]}


def _mixture(cfg: dict) -> Mixture:
    sources = {"a": list(range(1000, 1000 + cfg["sizes"][0])), "b": Counter(2000, 400),
               "c": list(range(3000, 3000 + cfg["sizes"][1]))}
    names = ["a", "b", "c"]
    if cfg["nested"]:
        sources["inner"] = Mixture({"x": list(range(5000, 5400)), "y": list(range(6000, 6400))},
                                   {"x": 1, "y": 3}, seed=cfg["seed"] + 1)
        names.append("inner")
    rng = random.Random(cfg["seed"])
    weights = {name: rng.choice([0.5, 1, 2, 3]) for name in names}
    if cfg["schedule"] == "stages":
        weights = Stages([(0, weights), (7, {name: 1 for name in names})])
    elif cfg["schedule"] == "ramp":
        weights = Ramp(4, 30, weights, {name: 1 + (name == "c") for name in names}, block=3)
    return Mixture(sources, weights, seed=cfg["seed"], on_exhausted=cfg["exhausted"], samples_per_epoch=400)


def _loader(cfg: dict, rank: int, workers: int):
    dl = DataLoader(_mixture(cfg), batch_size=cfg["bs"], num_workers=workers,
                    generator=torch.Generator().manual_seed(3))
    build = DispatchDataLoader if cfg["dispatch"] else IterableShardDataLoader
    return build.from_dataloader(dl, DistContext(rank, cfg["world"]), split_batches=cfg["split"])


def _configs(count: int = 8) -> list:
    rng = random.Random(28)
    found = []
    for n in range(count):
        world = 1 + n % 3
        cfg = dict(world=world, seed=rng.randrange(1000), schedule=["weights", "stages", "ramp"][n % 3],
                   dispatch=n % 4 == 3, split=n % 4 == 3 and world > 1, workers=[(0, 2), (2, 0)][n % 2],
                   nested=n % 3 == 1, exhausted=["stop", "restart"][n % 2], sizes=(400, 400) if n % 2 == 0 else (9, 7),
                   stops=sorted(rng.sample(range(1, 9), 2)), skip=n == 4)
        cfg["bs"] = 2 * world if cfg["split"] else 3
        name = "-".join(f"{k}{v}" for k, v in cfg.items() if k in ("world", "schedule", "dispatch", "workers", "nested",
                                                                      "exhausted", "skip"))
        found.append(pytest.param(cfg, id=name.replace(" ", "").replace(",", "")))
    return found


def _run(loaders: list, steps: int, passes: list) -> list[list[list[int]]]:
    """Each rank's next ``steps`` batches; the passes stay in progress (kept in ``passes``) for the save."""
    passes += [iter(loader) for loader in loaders]
    return [[next(it).tolist() for _ in range(steps)] for it in passes[-len(loaders):]]


def _saved(tmp_path, name: str, loaders: list):
    return save_checkpoint(tmp_path / name, [[loader.state_dict() for loader in loaders]])


def _answers(ckpt) -> list[list[list[dict]]]:
    out = cli_json("samples", ckpt, "--consumed")
    return [[[{"source": s["source"], "document": s["document"]} for s in b["samples"]] for b in r["batches"]]
            for r in out["ranks"]]


@pytest.mark.parametrize("cfg", _configs())
def test_samples_name_the_source_and_document_the_loaders_and_their_resumed_runs_yielded(tmp_path, cfg):
    world, (first, second) = cfg["world"], cfg["stops"]
    loaders = [_loader(cfg, r, cfg["workers"][0]) for r in range(world)]
    if cfg["skip"]:
        for loader in loaders:
            loader.skip_samples(40, 45)
    passes: list = []
    taken = _run(loaders, first, passes)
    ckpt = _saved(tmp_path, "first", loaders)
    assert _answers(ckpt) == [[[_named(i) for i in batch] for batch in batches] for batches in taken]

    resumed = [_loader(cfg, r, cfg["workers"][1]) for r in range(world)]
    for rank, loader in enumerate(resumed):
        loader.load_state_dict(_files.read_loader_state(ckpt, 0, rank))
    more = _run(resumed, second, passes)
    answers = _answers(_saved(tmp_path, "second", resumed))
    assert answers == [[[_named(i) for i in batch] for batch in taken[r] + more[r]] for r in range(world)]
    step = random.Random(first).randrange(first + second)
    out = cli_json("samples", tmp_path / "second", "--step", step, "--rank", world - 1)
    assert [b["step"] for b in out["ranks"][0]["batches"]] == [step]
    assert out["ranks"][0]["batches"][0]["samples"] == [
        dict(_named(i), index=k) for i, k in zip((taken[-1] + more[-1])[step], out["ranks"][0]["batches"][0]["indices"])]
