"""Everyday loops resume exactly: warm-up peeks, evaluation cut short, ``zip``, truncated epochs, and
Accelerate's classic ``skip_first_batches`` recipe, on simulated ranks of 1, 2 and 3 processes.

Each loop is written as a user writes it (``script(loaders, log, checkpoint)``). The uninterrupted run
records its log and every rank's loader states at each ``checkpoint()``; a run started afresh from each
of those states (as plain data), and a second resume from a checkpoint that resumed run wrote, must
continue the log exactly. "Training" is a real optimizer step (any ``optimizer.step()`` counts, see
``accelerate_stateful.training._training``).
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import DataLoader

from accelerate_stateful import DistContext, Phase, ShardDataLoader, SkipDataLoader
from accelerate_stateful.loaders._putback import checkpoint_states



def through_files(state: dict) -> dict:
    """The state as plain data, as a checkpoint holds it (files round trips are tested in test_files.py)."""
    return json.loads(json.dumps(state))

EPOCHS = 3
# Lengths never a multiple of the global batch; shuffled and not; drop_last; uneven ranks; split batches.
CONFIGS = [
    dict(n=11, bs=2, shuffle=True),
    dict(n=13, bs=3, shuffle=True, drop_last=True),
    dict(n=10, bs=2, shuffle=False, even=False),
    dict(n=19, bs=6, shuffle=True, split=True),
]
WORLDS = [1, 2, 3]
CASES = [(w, c) for w in WORLDS for c in CONFIGS]
IDS = [f"w{w}-n{c['n']}-bs{c['bs']}" + "".join(f"-{k}" for k in ("drop_last", "even", "split") if k in c)
       for w, c in CASES]

_weight = torch.nn.Parameter(torch.zeros(1))
_optimizer = torch.optim.SGD([_weight], lr=0.0)


def train() -> None:
    """One training step, as a loop's ``optimizer.step()``."""
    _optimizer.step()


def make(cfg: dict, world: int, rank: int, n: int = 0, seed: int = 3) -> ShardDataLoader:
    dl = DataLoader(list(range(n or cfg["n"])), batch_size=cfg["bs"], shuffle=cfg["shuffle"],
                    drop_last=cfg.get("drop_last", False), generator=torch.Generator().manual_seed(seed))
    return ShardDataLoader.from_dataloader(dl, DistContext(rank, world), even_batches=cfg.get("even", True),
                                           split_batches=cfg.get("split", False))


def ids(batch) -> list:
    return batch.tolist()


def through_files_of(loaders) -> list:
    """What ``accelerator.save_state()`` records: the save is an event (``checkpoint._in_step``): every pending
    verdict is taken, then each state is read as the checkpoint records it (batches not trained yet put back).
    (It also collects garbage where a pass is open; these loops make no reference cycles, so a collection would
    change nothing, and it would cost ~50 ms per checkpoint.)"""
    for loader in loaders:
        loader._life.settle()
    return [through_files(state) for state in checkpoint_states(loaders[0].ctx, loaders, "save")]


class Recorder:
    """A run of ``script`` on one rank: its log, and the loader states at each checkpoint."""

    def __init__(self, script, loaders, log=None) -> None:
        self.log, self.saves = list(log or []), []
        script(loaders, self.log, lambda: self.saves.append((len(self.log), through_files_of(loaders))))


def fresh_start(loaders):
    """What ``accelerator.resume()`` does to the loaders when it finds no checkpoint: the program starts here."""
    for loader in loaders:
        loader._anchor()
    return loaders


def check_every_resume(script, build, world: int, skip=lambda rank, states: False, chains: int = 2) -> int:
    """Resume ``script`` at every checkpoint of its uninterrupted run (and chains of two), on every rank.

    ``build`` makes the loaders as the script's set-up does before ``accelerator.resume()``; the
    uninterrupted run then starts as a resume that found nothing does, the others load a state.
    """
    compared = 0
    for rank in range(world):
        reference = Recorder(script, fresh_start(build(rank)))
        assert reference.saves, "the script never checkpoints"
        for index, (at, states) in enumerate(reference.saves):
            if skip(rank, states):
                continue
            loaders = build(rank)
            for loader, state in zip(loaders, states):
                loader.load_state_dict(state)
            resumed = Recorder(script, loaders, reference.log[:at])
            assert resumed.log == reference.log, f"rank {rank}: resumed at checkpoint {index} (log {at}) differs"
            compared += 1
            for again_at, again in resumed.saves[1:][:: max(len(resumed.saves) // chains, 1)]:
                if skip(rank, again):
                    continue
                loaders = build(rank)
                for loader, state in zip(loaders, again):
                    loader.load_state_dict(state)
                chained = Recorder(script, loaders, resumed.log[:again_at])
                assert chained.log == reference.log, f"rank {rank}: chain {index} -> log {again_at} differs"
                compared += 1
    return compared


def own_epochs(log, *loaders):
    """The epochs of a loop that keeps its own epoch counter in the checkpoint (here: the ``("after", epoch)``
    entries its log holds) and calls ``set_epoch`` with it at the top of each epoch, the idiom for code after
    the inner loop (an evaluation) that must run once per epoch, a resume at an epoch's last batch included
    (``docs/lifecycle.md``)."""
    for epoch in range(sum(1 for entry in log if entry[0] == "after"), EPOCHS):
        for loader in loaders:
            loader.set_epoch(epoch)
        yield epoch


# --------------------------------------------------------------------------- warm-up peeks, iter() twice
def plain_loop(loaders, log, checkpoint) -> None:
    (dl,) = loaders
    for epoch in own_epochs(log, dl):
        for batch in dl:
            train()
            log.append((epoch, ids(batch), dl.end_of_dataloader))
            checkpoint()
        log.append(("after", epoch))  # code after the inner loop (evaluation) runs once per epoch
        checkpoint()


@pytest.mark.parametrize("world,cfg", CASES, ids=IDS)
@pytest.mark.parametrize("peek", ["next-iter", "iter-twice", "next-iter-twice"])
def test_a_warm_up_peek_after_resuming_is_neutral(world, cfg, peek):
    """A warm-up ``next(iter(dl))`` (or ``iter()`` twice) after resuming leaves the loader where it was."""
    def script(loaders, log, checkpoint):
        dl = loaders[0]
        if peek == "next-iter":
            next(iter(dl))
        elif peek == "iter-twice":
            iter(dl), iter(dl)
        else:
            first = iter(dl)
            next(first), next(iter(dl))  # the second iter() closes the first
        plain_loop(loaders, log, checkpoint)

    def at_a_restored_epoch_end(rank, states):  # there the peek reads the epoch's empty rest (next test)
        return states[0]["batches_yielded"] == len(make(cfg, world, rank)) > 0

    assert check_every_resume(script, lambda r: [make(cfg, world, r)], world, skip=at_a_restored_epoch_end) > 0


@pytest.mark.parametrize("world", WORLDS)
def test_a_peek_at_a_restored_epoch_end_returns_a_batch_and_the_loop_still_finds_the_epochs_rest(world):
    """A script that peeks at the top of every epoch, saved right after an epoch's last batch: after the
    resume the peek is served from the next epoch and undone; the loop, which asked ``dl.epoch``, re-enters
    the finished epoch (its empty rest), then reads the next epoch whole."""
    cfg = CONFIGS[0]
    run = fresh_start([make(cfg, world, 0)])[0]
    next(iter(run))
    for _ in run:
        train()
        saved = through_files(run.state_dict())  # inside the loop, after the epoch's last batch
    second_epoch = [ids(b) for b in run]
    restored = make(cfg, world, 0)
    restored.load_state_dict(saved)
    assert restored.epoch == 0 and restored.batches_yielded == len(restored)
    assert ids(next(iter(restored))) == second_epoch[0]  # the peek: undone
    assert [ids(b) for b in restored] == []  # the rest of epoch 0, as the uninterrupted loop saw it end
    assert [ids(b) for b in restored] == second_epoch


@pytest.mark.parametrize("how", ["set_epoch", "skip_first_batches"])
@pytest.mark.parametrize("world", WORLDS)
def test_a_loop_that_counts_its_own_epochs_moves_to_the_next_epoch_after_a_resume_at_an_epoch_end(world, how):
    """``start = step // len(dl)`` (Accelerate's examples) says where it stands by moving the loader, with
    ``set_epoch(start)`` or ``skip_first_batches(dl, step % len(dl))``: the next pass is the next epoch whole."""
    cfg = CONFIGS[0]
    run = make(cfg, world, 0)
    for _ in run:
        saved = through_files(run.state_dict())
    second_epoch = [ids(b) for b in run]
    restored = make(cfg, world, 0)
    restored.load_state_dict(saved)
    step = len(restored)  # the loop's own count, saved with its checkpoint
    if how == "set_epoch":
        restored.set_epoch(step // len(restored))
    else:
        restored.seek(step % len(restored))  # what skip_first_batches does to a prepared loader
    assert [ids(b) for b in restored] == second_epoch


@pytest.mark.parametrize("world", WORLDS)
def test_a_query_on_one_process_at_a_restored_epoch_end_changes_nothing(world):
    """Between two epochs after a resume the next pass goes on in the finished epoch (its rest is empty),
    whether the program asked ``dl.epoch`` or not: a log line on the main process only decides nothing
    (issue 25: it used to re-enter the finished epoch on that process only)."""
    cfg = CONFIGS[0]
    run = make(cfg, world, 0)
    for _ in run:
        saved = through_files(run.state_dict())
    second_epoch = [ids(b) for b in run]
    passes = []
    for asks in (True, False):
        restored = make(cfg, world, 0)
        restored.load_state_dict(saved)
        if asks:
            assert (restored.epoch, restored.batches_yielded) == (0, len(restored))
            repr(restored), restored.progress(), restored.phase, restored.state_dict()
        passes.append([[ids(b) for b in restored], [ids(b) for b in restored]])
    assert passes[0] == passes[1] == [[], second_epoch]


@pytest.mark.parametrize("world,cfg", CASES, ids=IDS)
def test_a_peek_before_resuming_is_neutral_at_every_save_point(world, cfg):
    def build(rank):
        dl = make(cfg, world, rank)
        next(iter(dl))
        return [dl]

    assert check_every_resume(plain_loop, build, world) > 0


# --------------------------------------------------------------------------- evaluation cut short
@pytest.mark.parametrize("world,cfg", CASES, ids=IDS)
def test_an_evaluation_stopped_after_a_few_batches_restarts_as_in_the_uninterrupted_run(world, cfg):
    def script(loaders, log, checkpoint):
        train_dl, eval_dl = loaders
        for epoch in own_epochs(log, train_dl):
            for batch in train_dl:
                train()
                log.append(("train", epoch, ids(batch)))
                if train_dl.batches_yielded % 2 == 0:
                    for i, eval_batch in enumerate(eval_dl):  # max_eval_steps=2: no training here
                        log.append(("eval", ids(eval_batch), eval_dl.end_of_dataloader))
                        if i == 1:
                            break
                checkpoint()
            log.append(("after", epoch))
            checkpoint()

    eval_cfg = dict(cfg, shuffle=True, drop_last=False)
    build = lambda r: [make(cfg, world, r), make(eval_cfg, world, r, n=cfg["n"] + 17, seed=9)]  # noqa: E731
    assert check_every_resume(script, build, world) > 0


# --------------------------------------------------------------------------- zip, truncated epochs
@pytest.mark.parametrize("world,cfg", CASES, ids=IDS)
def test_the_longer_loader_of_a_zip_reads_a_new_epoch_each_time_and_resumes_exactly(world, cfg):
    long_cfg = dict(cfg, shuffle=True)

    def script(loaders, log, checkpoint):
        short, long = loaders
        for epoch in own_epochs(log, short):
            for a, b in zip(short, long):
                train()
                log.append((epoch, ids(a), ids(b)))
                if short.batches_yielded < len(short):  # not at the short loader's last batch (see lifecycle.md)
                    checkpoint()
            log.append(("after", epoch))
            checkpoint()

    build = lambda r: [make(cfg, world, r), make(long_cfg, world, r, n=3 * cfg["n"], seed=5)]  # noqa: E731
    reference = Recorder(script, build(0))
    per_epoch = [[x[2] for x in reference.log if len(x) == 3 and x[0] == epoch] for epoch in range(EPOCHS)]
    fresh = make(long_cfg, world, 0, n=3 * cfg["n"], seed=5)
    for epoch in range(EPOCHS):
        fresh.set_epoch(epoch)
        assert per_epoch[epoch] == [ids(b) for b in fresh][: len(per_epoch[epoch])], f"epoch {epoch}"
    assert check_every_resume(script, build, world) > 0


@pytest.mark.parametrize("world,cfg", CASES, ids=IDS)
def test_epochs_truncated_by_break_are_successive_epochs_and_resume_exactly(world, cfg):
    """``break`` after N trained batches per epoch, no ``set_epoch``: each epoch is the next epoch's order."""
    steps = 2

    def script(loaders, log, checkpoint):
        (dl,) = loaders
        for epoch in range(dl.epoch, EPOCHS):
            for batch in dl:
                train()
                log.append((epoch, ids(batch)))
                if dl.batches_yielded >= steps:
                    break
                checkpoint()
            # No code after the inner loop is logged: restarting at dl.epoch, a resume at an epoch's last batch
            # starts the next epoch and does not run it again (the loops above keep their own epoch for that).
            checkpoint()

    build = lambda r: [make(cfg, world, r)]  # noqa: E731
    reference = Recorder(script, build(0))
    fresh = make(cfg, world, 0)
    for epoch in range(EPOCHS):
        fresh.set_epoch(epoch)
        assert [b for e, b in reference.log if e == epoch] == [ids(b) for b in fresh][:steps]
    assert check_every_resume(script, build, world) > 0


def test_a_pass_dropped_without_training_is_undone_even_after_its_last_batch():
    """A peek that happens to take the epoch's last batch is still a peek; trained on, the epoch is over."""
    loader = make(CONFIGS[0], 1, 0)
    for i, _ in enumerate(loader):
        if i == len(loader) - 1:
            break
    iter(loader)  # the loader's next event takes the verdict on the pass let go
    assert loader.epoch == 0 and loader.phase is Phase.NOT_STARTED
    for i, _ in enumerate(loader):
        train()
        if i == len(loader) - 1:
            break
    iter(loader)
    assert loader.epoch == 1 and loader.phase is Phase.EXHAUSTED


# --------------------------------------------------------------------------- Accelerate's classic recipe
def classic_recipe(every: int):
    """``examples/complete_nlp_example.py``: step checkpoints, ``step // len``, ``skip_first_batches``."""
    def script(loaders, log, checkpoint, resume_step=None):
        (train_dl,) = loaders
        overall_step, starting_epoch = 0, 0
        if resume_step is not None:  # accelerator.load_state(path) already ran; path is f"step_{resume_step}"
            starting_epoch = resume_step // len(train_dl)
            resume_step -= starting_epoch * len(train_dl)
            overall_step = starting_epoch * len(train_dl)
        for epoch in range(starting_epoch, EPOCHS):
            if resume_step is not None and epoch == starting_epoch:
                active = SkipDataLoader(train_dl, resume_step)  # accelerator.skip_first_batches(...)
                overall_step += resume_step
            else:
                active = train_dl
            for batch in active:
                train()
                log.append((epoch, ids(batch)))
                overall_step += 1
                if overall_step % every == 0:
                    checkpoint()
    return script


EVEN = [(i, w, c) for i, (w, c) in zip(IDS, CASES) if c.get("even", True)]  # the recipe counts rank 0's steps


@pytest.mark.parametrize("world,cfg", [(w, c) for _, w, c in EVEN], ids=[i for i, _, _ in EVEN])
@pytest.mark.parametrize("every", [1, 2])
def test_accelerates_classic_recipe_resumes_exactly_at_every_step_checkpoint(world, cfg, every):
    """The step count in the checkpoint's name is how many batches the recipe took; at an epoch boundary
    ``skip_first_batches(dl, 0)`` starts the next epoch, not the one just finished."""
    recipe = classic_recipe(every)
    for rank in range(world):
        reference = Recorder(recipe, [make(cfg, world, rank)])
        for at, states in reference.saves:
            log = reference.log[:at]
            for link in range(2):  # a resume, then a resume of the run it continued into
                loader = make(cfg, world, rank)
                loader.load_state_dict(states[0])
                resumed = Recorder(lambda ls, lg, ck: recipe(ls, lg, ck, resume_step=len(log)), [loader], log)
                assert resumed.log == reference.log, f"rank {rank}: resumed at step {len(log)} (link {link})"
                if len(resumed.saves) < 2:
                    break
                at, states = resumed.saves[1]
                log = resumed.log[:at]
