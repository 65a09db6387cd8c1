"""``accelerate-stateful samples`` against the real loaders: what it prints is what a resumed loader yields.

Ranks are simulated in this process (``DistContext``) over a dataset whose sample ``i`` is the index ``i``,
so a batch *is* the list of dataset indices. For every configuration (world size, shuffle, ``drop_last``,
``even_batches``, ``split_batches``, save point) the tool's answers from the checkpoint alone must equal:
``--consumed`` what each rank took before the save, ``--remaining`` both the uninterrupted rest of the epoch
and what a loader resumed from the files yields, ``--step N`` the rank's N-th batch, and ``--world-size M``
what each rank of an elastic resume on M processes yields.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch.utils.data import DataLoader, SequentialSampler

from accelerate_stateful import DispatchDataLoader, DistContext, ShardDataLoader
from accelerate_stateful.checkpoint import _files
from accelerate_stateful.cli import _indices

from cli_run import cli_json, run_cli, save_checkpoint

N = 23


def _configs() -> list:
    """World sizes 1 to 3; on several processes a half fraction of the four switches, so every pair of
    their values occurs (split_batches = shuffle xor drop_last xor even_batches)."""
    found = []
    for world, shuffle, drop_last, even in itertools.product((1, 2, 3), (False, True), (False, True), (True, False)):
        split = shuffle ^ drop_last ^ (not even)
        if world == 1 and (split or not even):
            continue  # one process: nothing is split or evened out
        bs = 6 if split else 4
        found.append(pytest.param(
            dict(world=world, shuffle=shuffle, drop_last=drop_last, even=even, split=split, bs=bs),
            id=f"w{world}-{'shuf' if shuffle else 'seq'}-drop{int(drop_last)}-even{int(even)}-split{int(split)}"))
    return found


def _dataloader(cfg: dict) -> DataLoader:
    generator = torch.Generator().manual_seed(11) if cfg["shuffle"] else None
    return DataLoader(list(range(N)), batch_size=cfg["bs"], shuffle=cfg["shuffle"], drop_last=cfg["drop_last"],
                      generator=generator)


def _shard(cfg: dict, rank: int, world: int) -> ShardDataLoader:
    return ShardDataLoader.from_dataloader(_dataloader(cfg), DistContext(rank, world), even_batches=cfg["even"],
                                           split_batches=cfg["split"])


def _dispatcher(cfg: dict, rank: int, world: int) -> DispatchDataLoader:
    return DispatchDataLoader.from_dataloader(_dataloader(cfg), DistContext(rank, world), split_batches=cfg["split"])


def _epoch(loader, epoch: int) -> list[list[int]]:
    loader.set_epoch(epoch)
    return [batch.tolist() for batch in loader]


def _rest_read_on_resume(loader, state) -> list[list[int]]:
    """What a loop resumed from ``state`` reads when it re-enters its epoch at ``dl.epoch`` (a checkpoint
    taken right after an epoch's last batch: that epoch's empty rest; see docs/lifecycle.md)."""
    loader.load_state_dict(state)
    assert loader.epoch >= 0  # asking where it is re-enters that epoch
    return [b.tolist() for b in loader]


def _check_against_loaders(tmp_path, cfg: dict, make) -> None:
    world = cfg["world"]
    full = [_epoch(make(cfg, r, world), 1) for r in range(world)]  # epoch 1: a resume must not redraw epoch 0
    common = min(len(batches) for batches in full)
    for taken in sorted({0, 1, common // 2, common - 1, common}):
        loaders = [make(cfg, r, world) for r in range(world)]
        for loader in loaders:
            loader.set_epoch(1)
        iterators = [iter(loader) for loader in loaders]
        for it in iterators:
            for _ in range(taken):
                next(it)
        ckpt = save_checkpoint(tmp_path / f"taken{taken}", [[loader.state_dict() for loader in loaders]])
        consumed = cli_json("samples", ckpt, "--consumed")
        remaining = cli_json("samples", ckpt, "--remaining")
        for rank in range(world):
            printed = [b["indices"] for b in consumed["ranks"][rank]["batches"]]
            assert printed == full[rank][:taken], f"consumed, rank {rank}, {taken} taken"
            rest = [b["indices"] for b in remaining["ranks"][rank]["batches"]]
            assert rest == [b.tolist() for b in iterators[rank]] == full[rank][taken:], f"remaining, rank {rank}"
            resumed = _rest_read_on_resume(make(cfg, rank, world), _files.read_loader_state(ckpt, 0, rank))
            assert resumed == rest, f"a loader resumed from the files, rank {rank}"
            for step in (0, len(full[rank]) - 1):
                one = cli_json("samples", ckpt, "--rank", rank, "--step", step)["ranks"][0]["batches"]
                assert one == [{"step": step, "indices": full[rank][step]}], f"--step {step}, rank {rank}"
        for new_world in {1, 2, 3, 4} - {world}:
            _check_elastic(ckpt, cfg, make, new_world, taken)


def _check_elastic(ckpt, cfg: dict, make, new_world: int, taken: int) -> None:
    if cfg["split"] and cfg["bs"] % new_world:
        assert run_cli("samples", ckpt, "--remaining", "--world-size", new_world)[0] == 3
        return
    states = [_files.read_loader_state(ckpt, 0, r) for r in range(cfg["world"])]
    printed = cli_json("samples", ckpt, "--remaining", "--world-size", new_world)
    assert printed["elastic"] and len(printed["ranks"]) == new_world
    for rank in range(new_world):
        resumed = make(cfg, rank, new_world)
        expected = _rest_read_on_resume(resumed, resumed.merge_rank_states(states))  # as Accelerator.load_state
        assert [b["indices"] for b in printed["ranks"][rank]["batches"]] == expected, (
            f"elastic {cfg['world']} -> {new_world}, rank {rank}, saved after {taken} batches")


@pytest.mark.parametrize("cfg", _configs())
def test_samples_equal_what_shard_loaders_take_yield_and_yield_after_an_elastic_resume(tmp_path, cfg):
    _check_against_loaders(tmp_path, cfg, _shard)


@pytest.mark.parametrize("cfg", [
    pytest.param(dict(world=2, shuffle=True, drop_last=False, even=True, split=False, bs=4), id="w2-shuf"),
    pytest.param(dict(world=3, shuffle=False, drop_last=False, even=True, split=True, bs=6), id="w3-split"),
    pytest.param(dict(world=2, shuffle=True, drop_last=True, even=True, split=False, bs=4), id="w2-drop"),
    pytest.param(dict(world=3, shuffle=True, drop_last=False, even=True, split=False, bs=3), id="w3-uneven"),
])
def test_samples_equal_what_dispatchers_take_yield_and_yield_after_an_elastic_resume(tmp_path, cfg):
    _check_against_loaders(tmp_path, cfg, _dispatcher)


def test_samples_of_a_continued_epoch_count_from_where_its_striping_began(tmp_path):
    cfg = dict(world=2, shuffle=True, drop_last=False, even=True, split=False, bs=4)
    first = [_shard(cfg, r, 2) for r in range(2)]
    live = [iter(loader) for loader in first]  # saved while the pass is live (a dropped pass is undone)
    for it in live:
        next(it)
    states = [loader.state_dict() for loader in first]
    continued = [_shard(cfg, r, 3) for r in range(3)]
    rests = []
    for loader in continued:
        loader.load_state_dict(loader.merge_rank_states(states))
        it = iter(loader)
        rests.append([next(it).tolist()] + [b.tolist() for b in it])
    ckpt_loaders = [_shard(cfg, r, 3) for r in range(3)]
    live = []
    for loader in ckpt_loaders:
        loader.load_state_dict(loader.merge_rank_states(states))
        live.append(iter(loader))
        next(live[-1])
    ckpt = save_checkpoint(tmp_path / "continued", [[loader.state_dict() for loader in ckpt_loaders]])
    consumed = cli_json("samples", ckpt, "--consumed")
    remaining = cli_json("samples", ckpt, "--remaining")
    for rank in range(3):
        assert consumed["ranks"][rank]["stripe_origin"] == 8
        assert [b["indices"] for b in consumed["ranks"][rank]["batches"]] == rests[rank][:1]
        assert [b["indices"] for b in remaining["ranks"][rank]["batches"]] == rests[rank][1:]
    status, out, _ = run_cli("samples", ckpt, "--consumed", "--rank", 0)
    assert status == 0 and "steps count from sample 8 of the epoch" in out


def test_samples_refuse_an_order_drawn_by_a_users_own_sampler(tmp_path):
    class Reversed(SequentialSampler):
        def __iter__(self):
            return iter(range(len(self.data_source) - 1, -1, -1))

    data = list(range(N))
    loader = ShardDataLoader.from_dataloader(DataLoader(data, batch_size=4, sampler=Reversed(data)), DistContext(0, 1))
    ckpt = save_checkpoint(tmp_path / "sampler", [[loader.state_dict()]])
    status, out, err = run_cli("samples", ckpt, "--remaining")
    assert status == 4 and out == ""
    assert "Reversed)" in err and "sequential and shuffle=True" in err and len(err.splitlines()) == 1
    assert run_cli("inspect", ckpt)[0] == 0  # inspecting needs no order


@pytest.mark.parametrize("args, message", [
    (("--loader", 1, "--remaining"), "the checkpoint has 1 loader(s)"),
    (("--rank", 2, "--remaining"), "has 2 rank(s)"),
    (("--step", 99), "--step 99: rank 0 has 6 batches"),
    (("--consumed", "--world-size", 3), "--world-size 3 needs --remaining"),
    (("--remaining", "--world-size", 0), "a count of at least 1"),
])
def test_samples_refuse_a_loader_rank_or_step_the_checkpoint_lacks(tmp_path, args, message):
    cfg = dict(world=2, shuffle=False, drop_last=False, even=True, split=False, bs=2)
    ckpt = save_checkpoint(tmp_path / "c", [[_shard(cfg, r, 2).state_dict() for r in range(2)]])
    status, out, err = run_cli("samples", ckpt, *args)
    assert status == 2 and out == "" and message in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("n, seed", [(0, 3), (1, 3), (2, 0), (23, 11), (1000, 2**40 + 7), (5000, 2**63 - 5),
                                     (20_001, 9), (_indices.PYTHON_SHUFFLE + 3, 2**32 + 1)])
def test_the_order_drawn_without_torch_is_torchs_randperm(n, seed):
    expected = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    assert _indices.randperm(n, seed) == expected


def test_the_shuffle_resolved_with_numpy_is_torchs_randperm_at_every_size():
    """The whole-array shuffle (above ``PYTHON_SHUFFLE`` samples) against torch at sizes and seeds drawn at
    random, small ones included, where a swap with itself or a chain of swaps through one position is common."""
    draw = random.Random(26)
    for _ in range(60):
        n, seed = draw.choice([draw.randint(2, 40), draw.randint(41, 3000)]), draw.getrandbits(64)
        expected = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
        assert _indices._randperm_numpy(n, seed) == expected, (n, seed)


def test_samples_of_an_epoch_shuffled_with_numpy_equal_what_the_loaders_yield(tmp_path, monkeypatch):
    """An epoch above ``PYTHON_SHUFFLE`` samples (lowered here: the command runs in this process): ``--step`` and
    ``--remaining`` from the checkpoint alone are what the loaders yielded and what a loader resumed from the
    files yields."""
    monkeypatch.setattr(_indices, "PYTHON_SHUFFLE", 5_000)
    size, world, taken = 9_321, 2, 37

    def make(rank):
        data = DataLoader(range(size), batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(4))
        return ShardDataLoader.from_dataloader(data, DistContext(rank, world))

    full = [[b.tolist() for b in make(rank)] for rank in range(world)]
    loaders = [make(rank) for rank in range(world)]
    iterators = [iter(loader) for loader in loaders]
    for it in iterators:
        for _ in range(taken):
            next(it)
    ckpt = save_checkpoint(tmp_path / "c", [[loader.state_dict() for loader in loaders]])
    remaining = cli_json("samples", ckpt, "--remaining")
    for rank in range(world):
        assert _indices.answerable([_files.read_loader_state(ckpt, 0, r) for r in range(world)], rank, world)
        rest = [b["indices"] for b in remaining["ranks"][rank]["batches"]]
        assert rest == full[rank][taken:] == _rest_read_on_resume(make(rank), _files.read_loader_state(ckpt, 0, rank))
        for step in (0, taken, len(full[rank]) - 1):
            one = cli_json("samples", ckpt, "--rank", rank, "--step", step)["ranks"][0]["batches"]
            assert one == [{"step": step, "indices": full[rank][step]}]


def test_samples_of_a_seedable_order_with_samples_left_out_equal_what_the_loaders_yield(tmp_path):
    """Accelerate's seedable sampler, ``skip_samples`` ranges in the saved and the next epoch, and a save after
    an epoch's last batch: what ``samples`` draws without torch is what the loaders read."""
    def make(rank):
        loader = ShardDataLoader.from_dataloader(DataLoader(list(range(N)), batch_size=3, shuffle=True),
                                                 DistContext(rank, 2), data_seed=5, use_seedable_sampler=True)
        loader.skip_samples(7, 10, epoch=0)
        loader.skip_samples(2, 4, epoch=1)
        return loader

    full = [[b.tolist() for b in make(r)] for r in range(2)]
    for taken in (1, len(full[1])):
        loaders = [make(r) for r in range(2)]
        iterators = [iter(loader) for loader in loaders]
        for it in iterators:
            for _ in range(taken):
                next(it)
        ckpt = save_checkpoint(tmp_path / f"t{taken}", [[loader.state_dict() for loader in loaders]])
        assert ckpt.joinpath(_files.SUBDIR).is_dir() and loaders[0].state_dict()["config"]["order"] == "seedable-random"
        consumed = cli_json("samples", ckpt, "--consumed")["ranks"]
        remaining = cli_json("samples", ckpt, "--remaining")["ranks"]
        for rank in range(2):
            assert [b["indices"] for b in consumed[rank]["batches"]] == full[rank][:taken]
            assert [b["indices"] for b in remaining[rank]["batches"]] == full[rank][taken:]


def test_samples_refuse_a_state_whose_order_is_not_the_one_its_seed_draws(tmp_path):
    cfg = dict(world=1, shuffle=True, drop_last=False, even=True, split=False, bs=4)
    state = _shard(cfg, 0, 1).state_dict()
    state["order_fingerprint"] = "0" * 16
    ckpt = save_checkpoint(tmp_path / "c", [[state]])
    status, out, err = run_cli("samples", ckpt, "--step", 0)
    assert status == 3 and out == "" and "order for epoch 0 (random) differs from the one saved" in err
