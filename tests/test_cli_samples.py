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
import json
import random

import pytest
import torch
from torch.utils.data import DataLoader, SequentialSampler

from accelerate_stateful import DispatchDataLoader, DistContext, ShardDataLoader
from accelerate_stateful.checkpoint import _files
from accelerate_stateful.cli import _indices

from cli_run import cli_json, run_cli, run_importtime, save_checkpoint

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


def test_an_epoch_longer_than_max_samples_is_left_to_the_loaders(monkeypatch):
    """Beyond ``MAX_SAMPLES`` torch draws the order faster: the setting is read at each question (the benchmark's
    "torch" variant lowers it)."""
    state = _shard(dict(world=1, shuffle=True, drop_last=False, even=True, split=False, bs=4), 0, 1).state_dict()
    assert _indices.answerable([state], 0, 1)
    monkeypatch.setattr(_indices, "MAX_SAMPLES", N - 1)
    assert not _indices.answerable([state], 0, 1)


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


# --------------------------------------------------------------------------- dispatchers, without torch
def _dispatch_cases(count: int = 36) -> list:
    """Configurations drawn at random (a fixed seed): dataset lengths that divide by a step and ones that do
    not, batch sizes 1 to 8, 1 to 4 processes before and after a resume on another number, ``drop_last``,
    ``split_batches``, shuffled or not, samples left out or not, and where each run saves."""
    draw, found = random.Random(2026), []
    while len(found) < count:
        world, later = draw.randint(1, 4), draw.randint(1, 4)
        split = draw.random() < 0.3
        bs = draw.choice([w for w in (1, 2, 3, 4, 5, 6, 8) if not split or w % world == 0])
        cfg = dict(n=draw.choice([1, 2, 5, 7, 12, 23, 24, 31, 48]), bs=bs, world=world, later=later, split=split,
                   shuffle=draw.random() < 0.6, drop_last=draw.random() < 0.3, seed=draw.randrange(2**40),
                   skip=draw.random() < 0.25, first=draw.choice(["none", "one", "mid", "last", "end", "all"]),
                   second=draw.choice(["none", "one", "mid", "all"]))
        found.append(pytest.param(cfg, id=f"{len(found):02d}-n{cfg['n']}-b{bs}-w{world}to{later}"
                                           f"{'-split' if split else ''}{'-shuf' if cfg['shuffle'] else ''}"
                                           f"{'-drop' if cfg['drop_last'] else ''}{'-skip' if cfg['skip'] else ''}"
                                           f"-{cfg['first']}-{cfg['second']}"))
    return found


def _dispatch(cfg: dict, rank: int, world: int, epoch: int = 1) -> DispatchDataLoader:
    generator = torch.Generator().manual_seed(cfg["seed"]) if cfg["shuffle"] else None
    data = DataLoader(list(range(cfg["n"])), batch_size=cfg["bs"], shuffle=cfg["shuffle"], drop_last=cfg["drop_last"],
                      generator=generator)
    loader = DispatchDataLoader.from_dataloader(data, DistContext(rank, world), split_batches=cfg["split"])
    if cfg["skip"] and cfg["n"] > 4:
        loader.skip_samples(cfg["n"] // 2, cfg["n"] // 2 + 2, epoch=1)
    loader.set_epoch(epoch)  # from epoch 1: a resume must not draw epoch 0's order
    return loader


def _whole(cfg: dict, world: int, epoch: int) -> list[list[list[int]]]:
    """Each rank's steps of an uninterrupted run of ``epoch`` on ``world`` processes."""
    return [[batch.tolist() for batch in _dispatch(cfg, rank, world, epoch)] for rank in range(world)]


def _take(iterators: list, count: str, total: int) -> list[list[list[int]]]:
    """Take ``count`` steps on every rank ("none", "one", "mid", "last": all but one, "end": all, "all": all
    and the end of the pass seen, after which the loader stands at the next epoch's start); what each took."""
    steps = {"none": 0, "one": min(1, total), "mid": total // 2, "last": max(total - 1, 0)}.get(count, total)
    taken = [[next(it).tolist() for _ in range(steps)] for it in iterators]
    if count == "all":
        for rank, it in enumerate(iterators):
            taken[rank] += [batch.tolist() for batch in it]
    return taken


def _dispatch_answers(ckpt, world: int) -> dict:
    """Every question ``samples`` answers on the checkpoint: each step alone, the consumed and the remaining
    steps, and the rest of the epoch after a resume on each other number of processes (``(status, error)``
    where refused)."""
    found = {"consumed": cli_json("samples", ckpt, "--consumed"), "remaining": cli_json("samples", ckpt, "--remaining")}
    for rank in range(world):
        for step in range(found["consumed"]["ranks"][rank]["batches_in_epoch"]):
            found[("step", rank, step)] = cli_json("samples", ckpt, "--rank", rank, "--step", step)
    for other in {1, 2, 3, 4} - {world}:
        status, out, err = run_cli("samples", ckpt, "--remaining", "--world-size", other, "--json")
        found[("elastic", other)] = json.loads(out) if status == 0 else (status, err)
    return found


def _check_dispatch_answers(found: dict, cfg: dict, world: int, expected: list, taken: int, states: list) -> None:
    """``expected[rank]``: the rank's steps of the epoch as the loaders take them (the consumed ones, then the
    rest), ``taken`` of them taken at the save; ``states``: the saved ones, for resumes on other numbers."""
    for rank in range(world):
        consumed = found["consumed"]["ranks"][rank]
        assert consumed["batches_taken"] == taken and consumed["batches_in_epoch"] == len(expected[rank])
        assert [b["indices"] for b in consumed["batches"]] == expected[rank][:taken], f"--consumed, rank {rank}"
        rest = [b["indices"] for b in found["remaining"]["ranks"][rank]["batches"]]
        assert rest == expected[rank][taken:], f"--remaining, rank {rank}"
        for step, batch in enumerate(expected[rank]):
            one = found[("step", rank, step)]["ranks"][0]["batches"]
            assert one == [{"step": step, "indices": batch}], f"--step {step}, rank {rank}"
    for other in {1, 2, 3, 4} - {world}:
        answer = found[("elastic", other)]
        if cfg["split"] and cfg["bs"] % other:
            assert answer[0] == 3 and f"processes={other}; change one of them" in answer[1]
            continue
        for rank in range(other):
            resumed = _dispatch(cfg, rank, other)
            rest = _rest_read_on_resume(resumed, resumed.merge_rank_states(states))
            printed = [b["indices"] for b in answer["ranks"][rank]["batches"]]
            assert printed == rest, f"--world-size {other}, rank {rank}"


@pytest.mark.parametrize("cfg", _dispatch_cases())
def test_samples_of_dispatchers_without_torch_are_what_they_take_and_read_on_before_and_after_an_elastic_resume(
        tmp_path, monkeypatch, cfg):
    """A property of every configuration: what ``samples`` derives from a dispatcher's checkpoint is what the
    dispatchers took before the save and read after it, resumed there or on any other number of processes; of a
    checkpoint saved after a resume on another number too, whose steps before the resume are those of a whole
    run at the new number (``cli/_dispatched``). The loaders rebuilt (for epochs too long to draw without torch)
    answer the same."""
    _check_dispatch_scenario(tmp_path, monkeypatch, cfg)


@pytest.mark.parametrize("cfg", [
    pytest.param(dict(n=23, bs=3, world=2, later=3, first="one", second="one"), id="2-to-3"),
    pytest.param(dict(n=31, bs=2, world=1, later=4, first="one", second="last"), id="1-to-4-last-step"),
    pytest.param(dict(n=23, bs=4, world=3, later=2, first="one", second="last"), id="3-to-2-last-step"),
    pytest.param(dict(n=29, bs=3, world=2, later=3, first="mid", second="mid"), id="2-to-3-mid"),
])
def test_samples_of_a_dispatcher_count_its_steps_from_where_a_resume_on_another_number_cut_them(
        tmp_path, monkeypatch, cfg):
    """Issue 26: the steps a dispatcher took after a resume on another number of processes begin at a reader
    batch that is not a whole number of the new steps; ``samples`` cut them again from the epoch's start
    (``--consumed``, ``--step N``: other samples than were taken). Here the last step is completed with fewer
    first samples than processes, or more."""
    cfg = dict(split=False, shuffle=True, drop_last=False, seed=7, skip=False, **cfg)
    _check_dispatch_scenario(tmp_path, monkeypatch, cfg)


def _check_dispatch_scenario(tmp_path, monkeypatch, cfg: dict) -> None:
    """Save on ``world`` processes after ``first`` steps, resume on ``later`` and save after ``second`` more: every
    answer on both checkpoints against the loaders (see the test above)."""
    world, later = cfg["world"], cfg["later"]
    loaders = [_dispatch(cfg, r, world) for r in range(world)]
    iterators = [iter(loader) for loader in loaders]
    taken = _take(iterators, cfg["first"], len(loaders[0]))
    states = [loader.state_dict() for loader in loaders]
    found = _dispatch_answers(save_checkpoint(tmp_path / "saved", [states]), world)
    expected = [taken[r] + [b.tolist() for b in iterators[r]] for r in range(world)]
    assert expected == _whole(cfg, world, 1)
    if cfg["first"] == "all":
        expected, taken = _whole(cfg, world, 2), [[] for _ in range(world)]
    _check_dispatch_answers(found, cfg, world, expected, len(taken[0]), states)
    if cfg["split"] and cfg["bs"] % later:
        return
    # Resumed on `later` processes (or the same number), then saved again after some steps: its steps before the
    # resume are those of a whole run at `later` (on the same number: what the first run took).
    resumed = [_dispatch(cfg, r, later) for r in range(later)]
    for loader in resumed:
        loader.load_state_dict(loader.merge_rank_states(states) if later != world else states[loader.ctx.rank])
    before = resumed[0].batches_yielded
    epoch = 2 if cfg["first"] == "all" else 1
    before_resume = taken if later == world else [steps[:before] for steps in _whole(cfg, later, epoch)]
    iterators = [iter(loader) for loader in resumed]
    more = _take(iterators, cfg["second"], len(resumed[0]) - before)
    states = [loader.state_dict() for loader in resumed]
    again = save_checkpoint(tmp_path / "again", [states])
    found = _dispatch_answers(again, later)
    expected = [before_resume[r] + more[r] + [b.tolist() for b in iterators[r]] for r in range(later)]
    if cfg["second"] == "all":
        expected, more, before = _whole(cfg, later, epoch + 1), [[]], 0
    _check_dispatch_answers(found, cfg, later, expected, before + len(more[0]), states)
    from accelerate_stateful.cli import _dispatched

    assert all(_dispatched.answerable(states, rank, later) for rank in range(later))  # (the answers above)
    monkeypatch.setattr(_dispatched, "MAX_SAMPLES", -1)
    assert _dispatch_answers(again, later) == found, "the loaders rebuilt answer otherwise"


def test_samples_of_a_dispatcher_saved_after_an_elastic_resume_import_no_torch(tmp_path):
    """The real command line on a checkpoint of 3 processes resumed from 2 (steps counted from a reader batch
    that does not divide by 3, a last step completed with the 2 first samples saved): what the tests above hold
    against the loaders, printed without importing torch or accelerate."""
    cfg = dict(n=31, bs=3, split=False, shuffle=True, drop_last=False, seed=5, skip=False)
    first = [_dispatch(cfg, r, 2) for r in range(2)]
    for it in [iter(loader) for loader in first]:
        next(it)
    states = [loader.state_dict() for loader in first]
    resumed = [_dispatch(cfg, r, 3) for r in range(3)]
    for loader in resumed:
        loader.load_state_dict(loader.merge_rank_states(states))
    for it in [iter(loader) for loader in resumed]:
        next(it)
    ckpt = save_checkpoint(tmp_path / "c", [[loader.state_dict() for loader in resumed]])
    for args in (("--consumed",), ("--step", "3", "--rank", "2", "--json"), ("--remaining", "--world-size", "4")):
        status, imported, out = run_importtime("samples", ckpt, *args)
        assert (status, out) == run_cli("samples", ckpt, *args)[:2] and status == 0, args
        assert not imported & {"torch", "accelerate"}, f"{args}: imported {sorted(imported & {'torch', 'accelerate'})}"


def test_samples_of_a_dispatcher_over_dict_samples_name_the_indices_its_last_step_is_completed_with(tmp_path):
    """The saved first samples are the run's data (here dicts), not indices: the loaders rebuilt over the indices
    could not join them to a step (a TypeError's traceback); as dataset indices they are the epoch's first."""
    class Tagged:
        def __len__(self):
            return 11

        def __getitem__(self, index):
            return {"x": torch.tensor(100 + index)}

    loaders = [DispatchDataLoader.from_dataloader(DataLoader(Tagged(), batch_size=2), DistContext(rank, 2))
               for rank in range(2)]
    iterators = [iter(loader) for loader in loaders]
    for it in iterators:
        next(it)
    ckpt = save_checkpoint(tmp_path / "c", [[loader.state_dict() for loader in loaders]])
    remaining = cli_json("samples", ckpt, "--remaining")["ranks"]
    for rank, it in enumerate(iterators):
        read = [(batch["x"] - 100).tolist() for batch in it]
        assert [b["indices"] for b in remaining[rank]["batches"]] == read
    assert [b["indices"] for b in remaining[1]["batches"]][-1] == [10, 0]  # 11 samples: completed with sample 0


@pytest.mark.parametrize("first", [pytest.param(torch.tensor(3), id="one-number"), pytest.param([], id="empty")])
def test_samples_refuse_a_dispatcher_whose_saved_first_samples_are_no_batch(tmp_path, first):
    loaders = [DispatchDataLoader.from_dataloader(DataLoader(list(range(N)), batch_size=2), DistContext(rank, 2))
               for rank in range(2)]
    for it in [iter(loader) for loader in loaders]:
        next(it)
    states = [dict(loader.state_dict(), first_samples=first) for loader in loaders]
    status, out, err = run_cli("samples", save_checkpoint(tmp_path / "c", [states]), "--remaining")
    assert status == 3 and out == "" and len(err.splitlines()) == 1
    assert "first samples of the epoch" in err and "the file is damaged" in err and "resume from another" in err
