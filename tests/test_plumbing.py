"""The plumbing users write around several loaders resumes exactly (issue 25, items 11 and 12).

``zip_longest`` of two training loaders of different lengths, ``chain(islice(b, k), a)``, a multi-task
round-robin whose exhausted tasks wait for the others, and an evaluation cut short with a save between two of
its batches: each loop is run uninterrupted, then resumed from every checkpoint it took (and chained once more),
on simulated ranks of 1, 2 and 3 processes (``test_loops``'s harness, which records what ``save_state`` records).

A loop's own position between two of its steps (``islice``'s count, which task of a round comes next) is the
loop's to save: these loops save where they keep none (in ``a``'s part of the chain, after a whole round).
"""

from __future__ import annotations

import itertools

import pytest

from test_loops import CASES, EPOCHS, IDS, Recorder, check_every_resume, fresh_start, ids, make, own_epochs, train


def maybe(batch):
    return None if batch is None else ids(batch)


@pytest.mark.parametrize("world,cfg", CASES, ids=IDS)
@pytest.mark.parametrize("set_epoch", [False, True], ids=["no-set_epoch", "set_epoch"])
def test_the_shorter_loader_of_a_zip_longest_stays_ended_after_a_resume_inside_the_longer_ones_epoch(
        world, cfg, set_epoch):
    """Saved after ``b`` ended and before ``a`` did: the resumed ``b`` is its ended epoch's empty rest, not its next
    epoch (nor, with ``set_epoch(epoch)`` on both, its finished epoch again); ``a``'s last batch ends its loader."""
    def script(loaders, log, checkpoint):
        a, b = loaders
        for epoch in range(a.epoch, EPOCHS):
            if set_epoch:
                a.set_epoch(epoch)
                b.set_epoch(epoch)
            for x, y in itertools.zip_longest(a, b):
                train()
                log.append((epoch, maybe(x), maybe(y), a.end_of_dataloader))
                checkpoint()
            log.append(("after", epoch))

    build = lambda r: [make(cfg, world, r, n=2 * cfg["n"], seed=5), make(cfg, world, r)]  # noqa: E731
    assert check_every_resume(script, build, world) > 0


@pytest.mark.parametrize("world,cfg", CASES, ids=IDS)
def test_the_first_batches_of_a_chain_are_not_trained_again_after_a_resume_in_the_second_loaders_part(world, cfg):
    """``chain(islice(b, 2), a)`` with ``set_epoch`` on both, saved in ``a``'s part: ``b.set_epoch(e)`` after the
    resume does not send ``b`` back to the start of the epoch whose 2 batches were trained."""
    def script(loaders, log, checkpoint):
        a, b = loaders
        for epoch in range(a.epoch, EPOCHS):
            a.set_epoch(epoch)
            b.set_epoch(epoch)
            for i, x in enumerate(itertools.chain(itertools.islice(b, 2), a)):
                train()
                log.append((epoch, ids(x)))
                if i >= 2:  # in a's part: islice's count is the loop's own
                    checkpoint()
            log.append(("after", epoch))

    build = lambda r: [make(cfg, world, r), make(cfg, world, r, n=2 * cfg["n"], seed=5)]  # noqa: E731
    assert check_every_resume(script, build, world) > 0


@pytest.mark.parametrize("world,cfg", CASES, ids=IDS)
def test_a_round_robin_over_three_tasks_whose_exhausted_tasks_wait_for_the_others_resumes_exactly(world, cfg):
    """Every iterator made again at each epoch; a task that ran out waits (its ``next`` answers ``None``) until all
    did. Saved after each round that trained: a task that had ended stays ended in the resumed epoch."""
    def script(loaders, log, checkpoint):
        for epoch in range(loaders[0].epoch, EPOCHS):
            its = [iter(dl) for dl in loaders]
            done = [False] * len(its)
            while not all(done):
                trained = False
                for k, it in enumerate(its):
                    batch = None if done[k] else next(it, None)
                    if batch is None:
                        done[k] = True
                        continue
                    train()
                    trained = True
                    log.append((epoch, k, ids(batch)))
                if trained:
                    checkpoint()
            log.append(("after", epoch))

    build = lambda r: [make(cfg, world, r), make(cfg, world, r, n=cfg["n"] + 7, seed=5),  # noqa: E731
                       make(cfg, world, r, n=cfg["n"] + 3, seed=7)]
    assert check_every_resume(script, build, world) > 0


@pytest.mark.parametrize("world,cfg", CASES, ids=IDS)
def test_an_evaluation_cut_short_and_saved_between_two_of_its_batches_begins_where_it_began_after_a_resume(
        world, cfg):
    """The uninterrupted run undoes the cut-short evaluation, so its next evaluation begins where this one did;
    after a resume from a save between two evaluation batches, the next evaluation does too (the resumed program
    goes back to its training loop: the rest of the interrupted evaluation is not run)."""
    def script(loaders, log, checkpoint):
        train_dl, eval_dl = loaders
        evals = sum(1 for entry in log if entry[0] == "eval-start")
        for epoch in own_epochs(log, train_dl):
            for batch in train_dl:
                train()
                log.append(("train", epoch, ids(batch)))
                if train_dl.batches_yielded % 2 == 0:
                    log.append(("eval-start", evals))
                    for i, eval_batch in enumerate(eval_dl):
                        log.append(("eval", evals, ids(eval_batch)))
                        checkpoint()
                        if i == 1:
                            break
                    evals += 1
                checkpoint()
            log.append(("after", epoch))
            checkpoint()

    eval_cfg = dict(cfg, shuffle=True, drop_last=False)
    build = lambda r: [make(cfg, world, r), make(eval_cfg, world, r, n=cfg["n"] + 17, seed=9)]  # noqa: E731
    compared = 0
    for rank in range(world):
        reference = Recorder(script, fresh_start(build(rank)))
        for at, states in reference.saves:
            loaders = build(rank)
            for loader, state in zip(loaders, states):
                loader.load_state_dict(state)
            before = reference.log[:at]
            interrupted = before[-1][1] if before[-1][0] == "eval" else None
            resumed = Recorder(script, loaders, before)
            expected = before + [e for e in reference.log[at:] if not (e[0] == "eval" and e[1] == interrupted)]
            assert resumed.log == expected, f"rank {rank}: resumed at log {at}"
            compared += 1
    assert compared > 0


# --------------------------------------------------------------------------- found by the generated programs
@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_warm_up_peek_after_a_resume_at_an_epochs_end_leaves_the_epoch_the_loop_reads(world):
    """``next(iter(dl), None)`` right after resuming, then ``range(dl.epoch, E)``: the peek is a re-run, undone at
    the loader's next event, so ``dl.epoch`` still answers the finished epoch (the loop re-enters it)."""
    def script(loaders, log, checkpoint):
        (dl,) = loaders
        next(iter(dl), None)
        for epoch in range(dl.epoch, EPOCHS):
            for batch in dl:
                train()
                log.append((epoch, ids(batch)))
                checkpoint()
            log.append(("after", epoch))

    assert check_every_resume(script, lambda r: [make(CASES[0][1], world, r)], world) > 0


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_peek_let_go_before_another_loaders_training_stays_a_peek(world):
    """A warm-up ``next(iter(a))``, then ``chain(islice(b, 1), a)`` trains ``b`` first: ``a``'s epoch is not ended
    by ``b``'s training (it was skipped whole, silently)."""
    def script(loaders, log, checkpoint):
        a, b = loaders
        for epoch in range(a.epoch, EPOCHS):
            next(iter(a))
            for i, x in enumerate(itertools.chain(itertools.islice(b, 1), a)):
                train()
                log.append((epoch, ids(x)))
                if i >= 1:
                    checkpoint()
            log.append(("after", epoch))

    cfg = CASES[0][1]
    build = lambda r: [make(cfg, world, r), make(cfg, world, r, n=2 * cfg["n"], seed=5)]  # noqa: E731
    reference = Recorder(script, fresh_start(build(0)))
    fresh = make(cfg, world, 0)
    assert [x[1] for x in reference.log if x[0] == 0][1:] == [ids(b) for b in fresh]  # epoch 0 is read
    assert check_every_resume(script, build, world) > 0


@pytest.mark.parametrize("world", [1, 2, 3])
def test_an_evaluation_at_the_top_of_a_step_after_moving_to_the_next_epoch_is_whole(world):
    """A loop that counts its epochs by steps moves on with ``set_epoch`` after a resume at an epoch's end; its
    first step evaluates at the top: that evaluation reads its batches (the resume is past its saved point)."""
    def script(loaders, log, checkpoint):
        train_dl, eval_dl = loaders
        step = sum(1 for entry in log if entry[0] == "train")
        train_dl.set_epoch(step // len(train_dl))
        for epoch in range(step // len(train_dl), EPOCHS):
            for batch in train_dl:
                for i, v in enumerate(eval_dl):
                    log.append(("eval", ids(v)))
                    if i == 1:
                        break
                train()
                log.append(("train", epoch, ids(batch)))
                checkpoint()

    cfg = CASES[0][1]
    build = lambda r: [make(cfg, world, r), make(cfg, world, r, n=cfg["n"] + 17, seed=9)]  # noqa: E731
    assert check_every_resume(script, build, world) > 0
