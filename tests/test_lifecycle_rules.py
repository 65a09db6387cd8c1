"""The lifecycle decided by program order (docs/lifecycle.md), one rule per test, in one process.

Real processes: ``test_lifecycle_mp.py`` (generated programs on 2 ranks, the agreement at save and load).
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
import weakref
from pathlib import Path

import psutil
import pytest
import torch
from accelerate.state import GradientState
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader, Dataset

from accelerate_stateful import Accelerator, DistContext, LifecycleError, ShardDataLoader

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")
ROOT = Path(__file__).resolve().parent.parent


def accelerator(**kw) -> Accelerator:
    return Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True), **kw)


def loader(n=12, batch_size=2, seed=0, **kw) -> DataLoader:
    return DataLoader(list(range(n)), batch_size=batch_size, shuffle=True,
                      generator=torch.Generator().manual_seed(seed), **kw)


def ids(batch) -> list:
    return batch.tolist()


def epoch_order(n=12, batch_size=2, seed=0, epoch=0) -> list:
    fresh = ShardDataLoader.from_dataloader(loader(n, batch_size, seed), DistContext(0, 1))
    fresh.set_epoch(epoch)
    return [ids(b) for b in fresh]


# --------------------------------------------------------------------------- training the loader cannot see
@pytest.mark.parametrize("update", ["manual", "optimizer", "accelerator.backward"])
def test_any_backward_through_a_prepared_model_is_training_so_a_break_truncates_the_epoch(update):
    acc = accelerator()
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, dl = acc.prepare(model, optimizer, loader())
    seen = []
    for _ in range(3):
        for i, batch in enumerate(dl):
            seen.append(ids(batch))
            loss = model(batch.float().view(-1, 1)).square().mean()
            if update == "accelerator.backward":
                acc.backward(loss)
            else:
                loss.backward()  # not accelerator.backward
            if update == "optimizer":
                optimizer.step()
            else:
                with torch.no_grad():  # a hand-written update: no optimizer.step either
                    for p in model.parameters():
                        p -= 0.01 * p.grad
            model.zero_grad()
            if i == 1:
                break
    assert seen == [b for epoch in range(3) for b in epoch_order(epoch=epoch)[:2]]
    assert dl.epoch == 2  # a pure read: the last pass let go is open until the loader's next event
    iter(dl)
    assert dl.epoch == 3


# --------------------------------------------------------------------------- GradientState follows the batch
def test_accumulation_syncs_on_the_last_batch_of_the_loader_the_batch_came_from_whatever_order_passes_began(
        tmp_path):
    """Two tasks interleaved with accumulation, resumed where the next batch is the second task's: the resumed
    run begins its passes in the other order, and its syncs are still the uninterrupted run's."""
    def run(resume: bool = False) -> list:
        GradientState._reset_state()
        acc = accelerator(gradient_accumulation_steps=4)
        torch.manual_seed(0)
        model = torch.nn.Linear(1, 1)
        model, a, b = acc.prepare(model, loader(8, 2, 1), loader(12, 2, 2))
        if resume:
            acc.load_state(str(tmp_path / "step4"))
        its, flags = {}, []
        for step in range(4 if resume else 0, 16):
            name = "a" if step % 3 == 0 else "b"
            if name not in its:
                its[name] = iter(a if name == "a" else b)
            batch = next(its[name], None)
            if batch is None:
                break
            with acc.accumulate(model):
                acc.backward(model(batch.float().view(-1, 1)).mean())
            flags.append((step, name, ids(batch), acc.sync_gradients, acc.gradient_state.end_of_dataloader))
            if step == 3:
                acc.save_state(str(tmp_path / "step4"))
        return flags

    uninterrupted = run()
    assert any(sync for *_, sync, _ in uninterrupted[4:])
    assert run(resume=True) == uninterrupted[4:]


def test_a_pass_kept_after_its_last_batch_is_no_longer_the_active_loader_once_another_loader_hands_out_a_batch():
    acc = accelerator()
    evaluation, train = acc.prepare(loader(12, 5), loader(12, 2))
    kept = iter(evaluation)
    for _ in range(len(evaluation)):
        next(kept)
    assert acc.gradient_state.end_of_dataloader and acc.gradient_state.remainder == 2
    train_it = iter(train)
    next(train_it)
    assert not acc.gradient_state.end_of_dataloader
    assert acc.gather_for_metrics(torch.arange(12)).numel() == 12


def test_a_collection_in_another_thread_does_not_move_a_loader_or_its_gradient_state():
    """A pass kept alive only by a reference cycle is let go when a collection runs, in whatever thread:
    that only flags it; the verdict waits for the loader's next event, on the caller's thread."""
    acc = accelerator()
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer, dl = acc.prepare(model, optimizer, loader())
    gc.disable()
    try:
        def take_two():
            it = iter(dl)
            next(it), next(it)
            optimizer.step()
            try:
                raise RuntimeError("kept")
            except RuntimeError as exc:
                kept = exc  # noqa: F841 (the traceback holds this frame, the frame holds `it`)

        take_two()
        before = (dl._epoch, dl._batches_taken(), list(acc.gradient_state.dataloader_references))
        thread = threading.Thread(target=gc.collect)
        thread.start()
        thread.join()
        assert (dl._epoch, dl._batches_taken(), list(acc.gradient_state.dataloader_references)) == before
        assert dl.epoch == 0 and dl.batches_yielded == 2  # a query judges nothing: the pass is still open
        iter(dl)  # an event: the pass let go is judged here, trained on, so its epoch was truncated
        assert dl.epoch == 1 and dl.batches_yielded == 0
        assert not acc.gradient_state.in_dataloader
    finally:
        gc.enable()


# --------------------------------------------------------------------------- workers and exits
class Corrupt(Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> int:
        if index == 21:
            raise ValueError("record 21 is corrupt")
        return index


def test_a_pass_ended_by_an_exception_stops_its_workers_at_once_even_while_the_exception_is_kept():
    acc = accelerator()
    dl = acc.prepare(DataLoader(Corrupt(), batch_size=2, num_workers=2))
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    kept = None
    try:
        for _ in dl:
            pass
    except ValueError as exc:
        kept = exc
    assert kept is not None and "record 21" in str(kept)
    alive = [p for p in psutil.Process().children(recursive=True)
             if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE]
    assert alive == []


def test_an_iterator_left_at_module_level_says_nothing_at_interpreter_exit(tmp_path):
    script = tmp_path / "left.py"
    script.write_text(textwrap.dedent("""
        import torch
        from torch.utils.data import DataLoader
        from accelerate.utils import DataLoaderConfiguration
        from accelerate_stateful import Accelerator

        accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
        for workers in (0, 2):
            dl = accelerator.prepare(DataLoader(list(range(20)), batch_size=4, shuffle=True, num_workers=workers))
            globals()[f"it{workers}"] = iter(dl)
            next(globals()[f"it{workers}"])
        print("done")
    """))
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr
    assert "Exception ignored" not in done.stderr and "Error" not in done.stderr, done.stderr


# --------------------------------------------------------------------------- refusals by reachability
def test_load_state_dict_refuses_a_reachable_iterator_and_takes_one_only_a_cycle_keeps():
    dl = ShardDataLoader.from_dataloader(loader(), DistContext(0, 1))
    state = dl.state_dict()
    held = iter(dl)
    next(held)
    with pytest.raises(LifecycleError, match="iterator over this loader is live"):
        dl.load_state_dict(state)
    del held
    gc.disable()
    try:
        def peek_and_keep_the_traceback():
            it = iter(dl)
            next(it)
            try:
                raise RuntimeError("kept")
            except RuntimeError as exc:
                kept = exc  # noqa: F841

        peek_and_keep_the_traceback()
        dl.load_state_dict(state)  # the peek is unreachable: collected, undone, then the load
    finally:
        gc.enable()
    assert [ids(b) for b in dl] == epoch_order()


def test_a_loader_let_go_is_freed_at_once_with_its_persistent_workers_without_the_garbage_collector():
    """No reference cycle through the lifecycle: a dropped loader's workers end when the program drops it,
    at the same point on every rank, not at a collection."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    gc.disable()
    try:
        dl = ShardDataLoader.from_dataloader(loader(num_workers=2, persistent_workers=True), DistContext(0, 1))
        it = iter(dl)
        next(it), next(it)
        del it
        list(dl)
        freed = weakref.ref(dl)
        del dl
        assert freed() is None
        alive = [p for p in psutil.Process().children(recursive=True)
                 if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE]
        assert alive == []
    finally:
        gc.enable()


# --------------------------------------------------------------------------- uneven shares agree
class _Stream(torch.utils.data.IterableDataset):
    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def _uneven_loaders(kind: str, world: int, n: int) -> list:
    """One loader per simulated rank whose shares of an epoch differ by a batch (in the uninterrupted run too)."""
    from accelerate_stateful import IterableShardDataLoader

    if kind == "stream per rank":  # each rank reads its own stream; rank r's is r batches longer
        return [IterableShardDataLoader.from_dataloader(DataLoader(_Stream(n + 2 * r), batch_size=2),
                                                        DistContext(0, 1)) for r in range(world)]
    return [ShardDataLoader.from_dataloader(loader(n, 2), DistContext(r, world), even_batches=False)
            for r in range(world)]


@pytest.mark.parametrize("kind", ["stream per rank", "shard, even_batches=False"])
@pytest.mark.parametrize("world, n", [(2, 21), (3, 19), (3, 27), (2, 9)])
def test_ranks_whose_shares_are_uneven_agree_at_every_step_of_the_same_program(kind, world, n):
    # The comparison at save/load is of program order (the live pass, what it handed out), never of a rank's
    # position in its own share: a rank whose share ended a batch early is at the same point of the program.
    loaders = _uneven_loaders(kind, world, n)
    lengths = [len(list(iter(dl))) for dl in loaders]  # each rank's share (an untrained pass: undone)
    assert len(set(lengths)) > 1, lengths
    iterators = [iter(dl) for dl in loaders]
    for step in range(min(lengths) + 1):
        keys = {dl._digest()[0] for dl in loaders}
        assert len(keys) == 1, f"step {step}: {[dl._digest() for dl in loaders]}"
        if step < min(lengths):
            for it in iterators:
                next(it)
    # the same program point with different keys is still refused: one rank lets its iterator go
    del iterators[0]
    gc.collect()
    assert len({dl._digest()[0] for dl in loaders}) > 1
