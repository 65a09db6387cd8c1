"""``accelerate-stateful samples`` of a stream through a ``Shuffled`` buffer: each taken step's samples as (source,
document), the buffer's draws replayed from its saved position (issues 26 and 28).

Items say where they come from as in ``test_cli_samples_sources`` (``a``: 1000.., ``b``: 2000.. a stateful
iterable, ``c``: 3000..; an inner mixture's ``x``: 5000..). For random configurations (seeds, buffer sizes, weights,
1 to 3 simulated ranks, 0 or 2 workers, the shard loader or the dispatcher, the buffer over a mixture, under one,
or over a list, sources that run out while the buffer empties) the loaders run to a save point, are resumed from
the files on another worker count and run to a second one: the tool's answers from each checkpoint alone must
equal what the real loaders yielded.
"""

from __future__ import annotations

import itertools
import random

import pytest

from accelerate_stateful.errors import CheckpointError
from torch.utils.data import DataLoader

from accelerate_stateful import DispatchDataLoader, DistContext, IterableShardDataLoader, Mixture, Packed, Shuffled
from accelerate_stateful.checkpoint import _files

from cli_run import cli_json, run_cli, save_checkpoint
from test_cli_samples_sources import _answers, _named, _run, _saved
from test_mixture import Counter


def _dataset(cfg: dict):
    rng = random.Random(cfg["seed"])
    n = cfg["n"]
    sources = {"a": list(range(1000, 1000 + n)), "b": Counter(2000, n), "c": list(range(3000, 3000 + n))}
    if cfg["shape"] == "under":  # each source shuffled below the mixture, one of them a buffer over a mixture
        sources["a"] = Shuffled(sources["a"], cfg["size"], seed=cfg["seed"] + 1)
        sources["inner"] = Shuffled(Mixture({"x": list(range(5000, 5000 + n))}, {"x": 1}, seed=7), 3, seed=2)
    weights = {name: rng.choice([0.5, 1, 2, 3]) for name in sources}
    if cfg["shape"] == "list":
        return Shuffled(list(range(1000, 1000 + n)), cfg["size"], seed=cfg["seed"])
    mix = Mixture(sources, weights, seed=cfg["seed"] + 3)
    return mix if cfg["shape"] == "under" else Shuffled(mix, cfg["size"], seed=cfg["seed"])


def _loaders(cfg: dict, workers: int) -> list:
    build = DispatchDataLoader if cfg["dispatch"] else IterableShardDataLoader
    return [build.from_dataloader(DataLoader(_dataset(cfg), batch_size=cfg["bs"], num_workers=workers),
                                  DistContext(r, cfg["world"])) for r in range(cfg["world"])]


def _configs() -> list:
    rng = random.Random(26)
    found = []
    for n, (shape, size, items) in enumerate([("over", 1, 400), ("over", 5, 400), ("over", 40, 400),
                                              ("under", 6, 400), ("list", 9, 400), ("over", 16, 12)]):
        world = 1 + n % 3
        cfg = dict(world=world, shape=shape, size=size, n=items, seed=rng.randrange(1000), bs=2, dispatch=n == 4,
                   workers=[(0, 2), (2, 0)][n % 2], stops=(2, 2) if items < 100 else sorted(rng.sample(range(1, 9), 2)))
        found.append(pytest.param(cfg, id=f"{shape}-buffer{size}-world{world}-workers{cfg['workers']}"
                                  + ("-dispatched" if n == 4 else "") + ("-sources-run-out" if items < 100 else "")))
    return found


def _as_named(cfg: dict, item: int) -> dict:
    return {"source": None, "document": item - 1000} if cfg["shape"] == "list" else _named(item)


@pytest.mark.parametrize("cfg", _configs())
def test_samples_name_what_a_shuffled_stream_and_its_resumed_run_yielded(tmp_path, cfg):
    world, (first, second) = cfg["world"], cfg["stops"]
    loaders = _loaders(cfg, cfg["workers"][0])
    passes: list = []
    taken = _run(loaders, first, passes)
    ckpt = _saved(tmp_path, "first", loaders)
    assert _answers(ckpt) == [[[_as_named(cfg, i) for i in batch] for batch in batches] for batches in taken]

    resumed = _loaders(cfg, cfg["workers"][1])
    for rank, loader in enumerate(resumed):
        loader.load_state_dict(_files.read_loader_state(ckpt, 0, rank))
    more = _run(resumed, second, passes)
    second_ckpt = _saved(tmp_path, "second", resumed)
    if cfg["n"] < 100:  # the buffer's source has run out, and the buffer is emptying
        snapshots = _files.read_loader_state(second_ckpt, 0, 0)["stream"]["snapshots"]
        assert any(snap["dataset"]["position"]["ended"] for snap in snapshots if snap is not None)
    assert _answers(second_ckpt) == [
        [[_as_named(cfg, i) for i in batch] for batch in taken[r] + more[r]] for r in range(world)]
    step = random.Random(first).randrange(first + second)
    out = cli_json("samples", tmp_path / "second", "--step", step, "--rank", world - 1)
    assert [{"source": s["source"], "document": s["document"]} for s in out["ranks"][0]["batches"][0]["samples"]] == [
        _as_named(cfg, i) for i in (taken[-1] + more[-1])[step]]


def _mixture() -> Mixture:
    return Mixture({"a": list(range(1000, 1100)), "c": list(range(3000, 3100))}, {"a": 1, "c": 2}, seed=4)


def _checkpoint(tmp_path, dataset, name: str = "ckpt", world: int = 2, steps: int = 4):
    loaders = [IterableShardDataLoader.from_dataloader(DataLoader(dataset(), batch_size=3), DistContext(r, world))
               for r in range(world)]
    _run(loaders, steps, [])
    return _saved(tmp_path, name, loaders)


def test_samples_of_a_shuffled_stream_do_not_import_torch(tmp_path):
    from test_cli_imports import _imported

    ckpt = _checkpoint(tmp_path, lambda: Shuffled(_mixture(), 10, seed=1))
    status, imported, out = _imported("samples", ckpt, "--step", "2")
    assert status == 0 and "step 2: " in out
    assert "torch" not in imported and "accelerate" not in imported, sorted(imported)


def _old_format(tmp_path, ckpt, world: int = 2):
    """The checkpoint as written before a Shuffled recorded its seed, size and its source's position after it."""
    def strip(part):
        if isinstance(part, dict) and "slots" in part:
            for key in ("seed", "buffer_size", "to"):
                del part[key]
        for value in part.values() if isinstance(part, dict) else part if isinstance(part, list) else ():
            strip(value)
    states = [_files.read_loader_state(ckpt, 0, r) for r in range(world)]
    strip(states)
    return save_checkpoint(tmp_path / "old", [states]), states


def test_a_shuffled_position_written_before_it_recorded_its_seed_is_still_unknown_and_still_resumes(tmp_path):
    ckpt = _checkpoint(tmp_path, lambda: Shuffled(_mixture(), 10, seed=1))
    old, states = _old_format(tmp_path, ckpt)
    status, out, err = run_cli("samples", old, "--consumed")
    assert status == 4 and out == ""
    assert "outermost source is a Shuffled: a Shuffled buffer's draws depend on its seed, which its saved position " \
           "does not record" in err

    def rest(state):
        loader = IterableShardDataLoader.from_dataloader(DataLoader(Shuffled(_mixture(), 10, seed=1), batch_size=3),
                                                         DistContext(0, 2))
        loader.load_state_dict(state)
        return [batch.tolist() for batch in loader]
    assert rest(states[0]) == rest(_files.read_loader_state(ckpt, 0, 0))  # the seed and the rest are not read

    child = _checkpoint(tmp_path, lambda: Mixture({"s": Shuffled(list(range(50)), 4, seed=2), "a": list(range(
        1000, 1100))}, {"s": 1, "a": 1}, seed=3), name="child")
    status, out, err = run_cli("samples", _old_format(tmp_path / "child", child)[0], "--consumed")
    assert status == 4 and "s:(item " in out and "a:" in out
    assert "source 's': its item" in err and "which its saved position does not record" in err


def test_a_resume_with_another_seed_is_refused_and_samples_refuse_a_buffer_its_draws_do_not_give(tmp_path):
    """A resume with another seed is refused at the load (the order would change); a saved buffer that the draws
    of its seed do not give (a position edited by hand) is answered "cannot be told", never guessed."""
    from accelerate_stateful.cli._read import NotAnswerable
    from accelerate_stateful.cli._shuffled import handed_out

    ckpt = _checkpoint(tmp_path, lambda: Shuffled(_mixture(), 10, seed=1), world=1)
    resumed = IterableShardDataLoader.from_dataloader(DataLoader(Shuffled(_mixture(), 10, seed=2), batch_size=3),
                                                      DistContext(0, 1))
    with pytest.raises(CheckpointError, match=r"seed=1, this one draws with seed=2"):
        resumed.load_state_dict(_files.read_loader_state(ckpt, 0, 0))
        next(iter(resumed))
    stream = Shuffled(list(range(500)), 10, seed=1)
    list(itertools.islice(iter(stream), 40))
    position = dict(stream.state_dict()["position"], seed=2)
    with pytest.raises(NotAnswerable, match=r"seed=2, buffer_size=10\) is not the one its draws give"):
        handed_out(position, [0, 39], 0)


def test_samples_say_a_shuffled_over_packed_rows_hides_their_documents(tmp_path):
    ckpt = _checkpoint(tmp_path, lambda: Shuffled(Packed([[7] * 5] * 60, 2), 4, seed=1), world=1)
    status, out, err = run_cli("samples", ckpt, "--step", "1")
    assert status == 4 and "(item " in out and "its item" in err and "documents' lengths" in err


@pytest.mark.parametrize("taken", [pytest.param(3000, id="source-lasting"), pytest.param(4900, id="buffer-emptying")])
def test_the_replayed_draws_over_many_blocks_are_the_buffers_own(taken):
    from accelerate_stateful.cli._shuffled import handed_out

    stream = Shuffled(list(range(5000)), 300, seed=9)  # item r is read number r
    handed = list(itertools.islice(iter(stream), taken))
    position = stream.state_dict()["position"]
    assert position["ended"] == (taken == 4900)
    ks = list(range(0, taken, 7)) + [taken - 1]
    assert handed_out(position, ks, 0) == [handed[k] for k in ks]
