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
    return [[_plain(next(it)) for _ in range(steps)] for it in passes[-len(loaders):]]


def _plain(batch):
    return batch.tolist() if isinstance(batch, torch.Tensor) else batch


def _saved(tmp_path, name: str, loaders: list):
    return save_checkpoint(tmp_path / name, [[loader.state_dict() for loader in loaders]])


def _answers(ckpt) -> list[list[list[dict]]]:
    out = cli_json("samples", ckpt, "--consumed")
    return [[[{"source": s["source"], "document": s["document"]} for s in b["samples"]] for b in r["batches"]]
            for r in out["ranks"]]


@pytest.mark.parametrize("cfg", _configs())
def test_samples_name_the_source_and_document_the_loaders_and_their_resumed_runs_yielded(tmp_path, cfg, monkeypatch):
    from accelerate_stateful.cli import _composed

    monkeypatch.setattr(_composed, "PYTHON_SWEEP", 20_000 if cfg["seed"] % 2 else 0)  # half the sweeps by numpy
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


def _checkpoint(tmp_path, dataset, steps: int = 3, world: int = 2, name: str = "ckpt", **loader):
    """A checkpoint of ``world`` simulated ranks, each having taken ``steps`` batches of a stream over ``dataset``."""
    loaders = [IterableShardDataLoader.from_dataloader(DataLoader(dataset, **{"batch_size": 3, **loader}),
                                                       DistContext(r, world)) for r in range(world)]
    passes: list = []
    _run(loaders, steps, passes)
    return _saved(tmp_path, name, loaders)


def _simple(seed: int = 4) -> Mixture:
    return Mixture({"a": list(range(1000, 1100)), "c": list(range(3000, 3100))}, {"a": 1, "c": 1}, seed=seed)


@pytest.mark.parametrize("args, message", [
    pytest.param(("--remaining",), "steps after the checkpoint depend on when its sources run out", id="remaining"),
    pytest.param(("--step", 3), "rank 0 had taken 3 steps of epoch 0 .* ask for a step from 0 to 2", id="a-later-step"),
])
def test_samples_refuse_a_streams_steps_not_taken_yet_since_its_end_is_not_recorded(tmp_path, args, message):
    status, out, err = run_cli("samples", _checkpoint(tmp_path, _simple()), *args)
    assert status == 4 and out == ""
    assert err.startswith("accelerate-stateful: error: ") and __import__("re").search(message, err)


def test_samples_say_which_source_a_packed_or_filtered_child_item_came_from_and_that_its_document_is_unknown(tmp_path):
    from accelerate_stateful import Filtered

    mix = Mixture({"a": list(range(1000, 1100)), "p": Packed([[7] * 5] * 50, 2),
                   "f": Filtered(list(range(100)), lambda x: x % 3 == 0)}, {"a": 1, "p": 1, "f": 1}, seed=2)
    status, out, err = run_cli("samples", _checkpoint(tmp_path, mix, collate_fn=lambda b: torch.tensor(
        [x if isinstance(x, int) else -1 for x in b])), "--consumed", "--rank", "0")
    assert status == 4 and "a:" in out and "p:(item " in out and "f:(item " in out
    assert "its item" in err and ("documents' lengths" in err or "predicate" in err)


def _even(item: int) -> bool:
    return item % 2 == 0


# An outermost Packed or Filtered is answered (test_cli_samples_packed, test_cli_samples_filtered); what such a
# source drew from a filter below it is named by the item's number there, with the reason.
def test_samples_of_a_filter_over_a_filter_name_the_inner_filters_items_by_number_and_say_why(tmp_path):
    from accelerate_stateful import Filtered

    status, out, err = run_cli("samples", _checkpoint(tmp_path, Filtered(Filtered(_simple(), _even), _even)),
                               "--consumed")
    assert status == 4 and "kept, 0 dropped of 6 drawn: (item 0) (item 1)" in out
    assert "it is a Filtered: which items a Filtered keeps depends on its predicate" in err
    assert "only where it is the loader's outermost source" in err


def test_samples_of_a_checkpoint_written_before_mixtures_recorded_their_seed_say_why_they_cannot_answer(tmp_path):
    ckpt = _checkpoint(tmp_path, _simple(), world=1)
    state = _files.read_loader_state(ckpt, 0, 0)
    for snap in state["stream"]["snapshots"]:
        del snap["dataset"]["position"]["seed"]
    old = save_checkpoint(tmp_path / "old", [[state]])
    status, _, err = run_cli("samples", old, "--consumed")
    assert status == 4 and "written before a Mixture recorded its seed" in err


def test_samples_name_an_epoch_continued_with_another_batch_size_from_where_its_blocks_began_again(tmp_path):
    """Resumed with batches of 2 after three of 3, the rest of the epoch is dealt again from the first item no share
    handed out (``loaders/_frontier``): samples names every batch of both dealings."""
    ckpt = _checkpoint(tmp_path, _simple(), world=1, drop_last=True)
    resumed = IterableShardDataLoader.from_dataloader(DataLoader(_simple(), batch_size=2, drop_last=True),
                                                      DistContext(0, 1))
    resumed.load_state_dict(_files.read_loader_state(ckpt, 0, 0))
    _run([resumed], 2, [])
    sequence = [int(i) for i in DataLoader(_simple(), batch_size=None)][:13]
    named = [{"source": "a" if i < 3000 else "c", "document": i - (1000 if i < 3000 else 3000)} for i in sequence]
    expected = [named[0:3], named[3:6], named[6:9], named[9:11], named[11:13]]
    assert _answers(_saved(tmp_path, "rebatched", [resumed])) == [expected]


def test_a_mixture_resumed_with_another_seed_is_refused_since_every_later_source_would_differ(tmp_path):
    from accelerate_stateful.errors import CheckpointError

    state = _files.read_loader_state(_checkpoint(tmp_path, _simple(4), world=1), 0, 0)
    mix = _simple(5)
    with pytest.raises(CheckpointError, match=r"drew its sources with seed=4, this one draws with seed=5.*seed=4\)"):
        mix.load_state_dict(state["stream"]["snapshots"][0]["dataset"])


def test_samples_of_a_mixture_stream_import_neither_torch_nor_numpy(tmp_path):
    """Issue 26 and 28: the source and document of each sample follow from the saved positions; no torch."""
    from test_cli_imports import HEAVY, _imported

    ckpt = _checkpoint(tmp_path, Mixture({"a": list(range(1000, 1100)), "inner": _simple()}, Ramp(
        2, 9, {"a": 1, "inner": 0}, {"a": 1, "inner": 3}, block=2), seed=3))
    status, imported, out = _imported("samples", ckpt, "--step", "2", "--json")
    assert status == 0 and json.loads(out)["ranks"][1]["batches"][0]["samples"]
    assert not imported & set(HEAVY), f"imported {sorted(imported & set(HEAVY))}"


@pytest.mark.parametrize("schedule", [
    pytest.param([[0, {"a": 1, "b": 2, "c": 0.5}]], id="weights"),
    pytest.param([[0, {"stages": [[0, {"a": 1, "b": 0}], [70, {"ramp": {"start": 80, "end": 300, "from": {"a": 1, "b": 0},
                                                                      "to": {"a": 0, "b": 1}, "block": 7}}]]}],
                  [150, {"a": 1, "b": 1, "c": 1}]], id="stages-ramp-and-a-source-added"),
])
def test_the_sources_drawn_with_numpy_for_a_long_sweep_are_the_mixtures_own_draws(schedule):
    from accelerate_stateful.cli._composed import _picked, _picked_numpy
    from accelerate_stateful.sources.schedule import Picker

    for seed, epoch in ((0, 0), (2**63 + 5, 3)):
        names = ["a", "b", "c"]
        assert list(_picked_numpy(Picker(seed, epoch, schedule), names, 13, 400)) == _picked(
            Picker(seed, epoch, schedule), names, 13, 400)
