"""Generated training programs over two prepared loaders, for the lifecycle property tests.

A program is drawn from a seed: its loaders (sizes, batch sizes, ``drop_last``), the shape of its inner
loop (``for``, a step-based ``it = iter(dl)``, ``zip``, a nested evaluation cut short, and the plumbing users
write around two training loaders: ``zip_longest``, ``chain(islice(b, k), a)``, a round-robin of two tasks, a
look-ahead prefetcher, a prefetcher thread filling a bounded queue), where it truncates
its epochs, whether it peeks at the top of each epoch or once after resuming, where it saves, when it
collects garbage, and on which rank it keeps a caught exception (a frame cycle that keeps an iterator
alive after its function returned) or turns the garbage collector off. Every program is written the way
users write loops that resume: it calls ``accelerator.load_state`` (or starts afresh), re-enters its
epochs at ``dl.epoch``, or at its own counters (``step // len(dl)`` then ``set_epoch``; its own epoch with
``set_epoch``),
and its counters are saved with the checkpoint (``register_for_checkpointing``).

``run()`` returns the trace (every batch trained on or evaluated, with its loader, the program's epoch
and Accelerate's ``sync_gradients``; the final weights), the trace length at each save, and the folder
of each save. A resumed run's trace must continue the uninterrupted one exactly.
"""

from __future__ import annotations

import gc
import itertools
import queue
import random
import shutil
import threading
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import torch
from accelerate.state import GradientState
from torch.utils.data import DataLoader

KEPT: list = []  # iterators a program keeps reachable on one rank (the refusal case)


@dataclass(frozen=True)
class Program:
    seed: int
    n_a: int
    bs_a: int
    drop_last: bool
    n_b: int
    bs_b: int
    pattern: str  # "for", "steps", "zip", "nested", "zip_longest", "chain", "roundrobin", "prefetch" or "thread"
    limit: Optional[int]  # steps per epoch: a break at the top ("for", "zip", "nested"), the count ("steps")
    restart: str  # "epoch" (range(dl.epoch, E)), "count" (step // len(dl)), "own" (own epoch + set_epoch)
    top_peek: bool
    prologue_peek: bool
    save_every: int
    save_offset: int
    save_after_loop: bool
    post_eval: int  # evaluation steps over B after the inner loop (0: none)
    keep_exception_rank: Optional[int] = None
    gc_off_rank: Optional[int] = None
    gc_every_rank: Optional[int] = None
    keep_live_rank: Optional[int] = None  # keeps the step iterator reachable on that rank: saves are refused
    epochs: int = 3
    query_rank: Optional[int] = None  # asks every query of both loaders, at many points, on that rank only
    eval_top_every: int = 0  # an evaluation cut short (break) at the top of every Nth step, after its batch
    depth: int = 1  # "chain": the batches of B before A; "prefetch": the batches fetched ahead; "thread": its queue
    accumulation: int = 2  # gradient accumulation steps (1 with a thread: docs/lifecycle.md)

    @property
    def refused(self) -> bool:
        return self.keep_live_rank is not None

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.__dict__.items())


def draw(seed: int, world: int, refusal: bool = False) -> Program:
    """A program, from ``seed``; ``refusal``: one that keeps an iterator reachable on one rank only."""
    rng = random.Random(seed)
    bs_a = rng.randint(1, 3)
    n_a = rng.randint(2 * world * bs_a, 5 * world * bs_a)
    pattern = "steps" if refusal else rng.choice(["for", "steps", "zip", "nested"])
    per_rank = _per_rank(n_a, bs_a, world, drop_last := rng.random() < 0.3)
    limit = None
    if pattern == "steps":
        limit = rng.randint(1, per_rank)
    elif rng.random() < 0.4:
        limit = rng.randint(1, max(per_rank - 1, 1))
    restart = rng.choice(["epoch", "own"] + (["count"] if pattern == "for" and limit is None else []))
    program = Program(
        seed=seed, n_a=n_a, bs_a=bs_a, drop_last=drop_last, n_b=rng.randint(world, 4 * world * 2),
        bs_b=rng.randint(1, 2), pattern=pattern, limit=limit, restart=restart, top_peek=rng.random() < 0.35,
        prologue_peek=rng.random() < 0.3, save_every=rng.randint(1, 3), save_offset=0,
        save_after_loop=rng.random() < 0.5, post_eval=0 if restart == "count" else rng.choice([0, 0, 1, 2]),
        keep_exception_rank=rng.choice([None, *range(world)]), gc_off_rank=rng.choice([None, *range(world)]),
        gc_every_rank=rng.choice([None, *range(world)]),
    )
    program = replace(program, save_offset=rng.randrange(program.save_every))
    asym = random.Random(seed * 31 + 7)  # drawn apart, so the fields above stay what they were for a seed
    program = replace(program, query_rank=asym.choice([None, *range(world)]),
                      eval_top_every=asym.choice([0, 0, 2, 3]) if pattern in ("for", "zip") else 0)
    if refusal:
        return replace(program, keep_live_rank=rng.randrange(world), save_after_loop=True)
    plumbing = random.Random(seed * 53 + 11)  # drawn apart too: the programs above stay what they were
    shape = plumbing.choice([None, None, "zip_longest", "chain", "prefetch", "roundrobin"])
    if shape == "prefetch" and per_rank <= 2:  # its queue would outlast its first epoch (docs/lifecycle.md)
        shape = "zip_longest"
    threads = random.Random(seed * 59 + 38)  # drawn apart too: some of the plumbing becomes a prefetcher thread
    if shape is not None and threads.random() < 0.3:
        shape = "thread"
    if shape is not None and program.restart != "count":  # the loop keeps no position between steps: no break
        program = replace(program, pattern=shape, limit=None, eval_top_every=0, depth=plumbing.randint(1, 2))
        if shape in ("prefetch", "thread") and program.save_after_loop:  # a save after its loop reads as one at its
            program = replace(program, restart="own")  # last step: the loop says which with its own epoch
        if shape == "thread":  # Accelerate's sync at an epoch's end follows the thread's reads (lifecycle.md)
            program = replace(program, depth=threads.randint(1, 3), accumulation=1)
    return program


def _per_rank(n: int, bs: int, world: int, drop_last: bool) -> int:
    steps = n // (bs * world) if drop_last else -(-n // (bs * world))
    return max(steps, 1)


class Counters:
    """The program's own counters, saved with the checkpoint."""

    def __init__(self) -> None:
        self.epoch, self.in_epoch, self.step, self.saves = -1, 0, 0, 0

    def state_dict(self) -> dict:
        return dict(self.__dict__)

    def load_state_dict(self, state: dict) -> None:
        self.__dict__.update(state)


class Run:
    """One run of a program in this process: prepares fresh objects, optionally loads a checkpoint."""

    def __init__(self, program: Program, accelerator: Any, root: Path, rank: int,
                 resume_from: Optional[Path] = None) -> None:
        self.p, self.acc, self.root, self.rank = program, accelerator, root, rank
        self.trace: list = []
        self.saves: list[tuple[int, int, Path]] = []  # (save number, trace length, folder)
        _fresh(accelerator)
        torch.manual_seed(program.seed)
        model = torch.nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        a = DataLoader(list(range(program.n_a)), batch_size=program.bs_a, shuffle=True,
                       drop_last=program.drop_last, generator=torch.Generator().manual_seed(program.seed))
        b = DataLoader(list(range(100, 100 + program.n_b)), batch_size=program.bs_b, shuffle=True,
                       generator=torch.Generator().manual_seed(program.seed + 1))
        accelerator.gradient_accumulation_steps = program.accumulation
        self.model, self.optimizer, self.a, self.b = accelerator.prepare(model, optimizer, a, b)
        self.ctr = Counters()
        accelerator.register_for_checkpointing(self.ctr)
        if resume_from is not None:
            accelerator.load_state(str(resume_from))

    # ----------------------------------------------------------------- the program
    def __call__(self) -> "Run":
        p, rank = self.p, self.rank
        if p.gc_off_rank == rank:
            gc.disable()
        try:
            self._query()
            if p.prologue_peek:  # right after a resume between two epochs the pass is that epoch's empty rest
                next(iter(self.a), None)
            self._query()
            for epoch in self._epochs():
                self._epoch_body(epoch)
            weights = [float(v) for param in self.model.parameters() for v in param.detach().flatten()]
            # NaN is recorded as a word: NaN != NaN would call two identical runs different
            self.trace.append(("weights", [round(v, 12) if v == v else "nan" for v in weights]))
        finally:
            gc.enable()
        return self

    def _epochs(self) -> range:
        p, a = self.p, self.a
        if p.restart == "epoch":
            return range(a.epoch, p.epochs)
        if p.restart == "count":  # it says where it stands, as Accelerate's examples do with skip_first_batches
            start = self.ctr.step // len(a)
            a.set_epoch(start)
            return range(start, p.epochs)
        return range(max(self.ctr.epoch, 0), p.epochs)

    def _epoch_body(self, epoch: int) -> None:
        p, a, ctr = self.p, self.a, self.ctr
        if epoch != ctr.epoch:
            ctr.epoch, ctr.in_epoch = epoch, 0
        if p.restart == "own":
            a.set_epoch(epoch)
            if p.pattern in ("zip_longest", "chain", "roundrobin"):
                self.b.set_epoch(epoch)
        self._query()
        if p.top_peek:
            next(iter(a))
        self._query()
        if p.pattern == "steps":
            self._steps(epoch)
        elif p.pattern == "thread":
            self._thread(epoch)
        elif p.pattern in ("zip_longest", "chain", "prefetch", "roundrobin"):
            self._plumbing(epoch)
        elif p.pattern == "zip":
            for batch, other in zip(a, self.b):
                self._query()
                if self._truncated():
                    break
                self._train(epoch, batch, other)
                self._maybe_save()
        else:
            for batch in a:
                self._query()
                if self._truncated():
                    break
                self._eval_at_top()
                self._train(epoch, batch)
                if p.pattern == "nested" and ctr.step % 2 == 0:
                    self._evaluate(2)
                self._maybe_save()
        self._query()
        if p.restart != "count":  # a loop that counts its epochs by steps skips this after a resume at the end
            if p.post_eval:
                self._evaluate(p.post_eval)
            self.trace.append(("after", epoch))
        ctr.epoch, ctr.in_epoch = epoch + 1, 0  # the epoch is done: a save from here on resumes at the next
        if p.save_after_loop:
            self._save()

    def _steps(self, epoch: int) -> None:
        p, ctr = self.p, self.ctr
        it = iter(self.a)
        kept = None
        for _ in range(ctr.in_epoch, p.limit):
            self._train(epoch, next(it))
            self._maybe_save()
            if p.keep_exception_rank == self.rank and kept is None:
                try:
                    raise RuntimeError("kept in a variable: its traceback holds this frame, and the frame `it`")
                except RuntimeError as exc:
                    kept = exc
        if p.keep_live_rank == self.rank:
            KEPT.append(it)

    def _plumbing(self, epoch: int) -> None:
        """Two training loaders through ``zip_longest`` or ``chain(islice(b, k), a)``, or a look-ahead prefetcher
        over A: each saves between its steps, where the loop keeps no position of its own."""
        p, a, b = self.p, self.a, self.b
        if p.pattern == "zip_longest":
            for batch, other in itertools.zip_longest(a, b):
                self._query()
                self._train(epoch, batch if batch is not None else other, other if batch is not None else None)
                self._maybe_save()
        elif p.pattern == "roundrobin":  # a task that ran out waits for the other; saves after whole rounds
            tasks, done = [iter(a), iter(b)], [False, False]
            while not all(done):
                trained = False
                for k, it in enumerate(tasks):
                    batch = None if done[k] else next(it, None)
                    if batch is None:
                        done[k] = True
                        continue
                    self._query()
                    self._train(epoch, batch)
                    trained = True
                if trained:
                    self._maybe_save()
        elif p.pattern == "chain":
            for i, batch in enumerate(itertools.chain(itertools.islice(b, p.depth), a)):
                self._query()
                self._train(epoch, batch)
                if i >= p.depth:  # in A's part: islice's count is the loop's own
                    self._maybe_save()
        else:
            it = iter(a)
            queue = deque(itertools.islice(it, p.depth))
            while queue:
                batch = queue.popleft()
                ahead = next(it, None)
                if ahead is not None:
                    queue.append(ahead)
                self._query()
                self._train(epoch, batch)
                self._maybe_save()

    def _thread(self, epoch: int) -> None:
        """A prefetcher thread: it calls ``next()`` on A's iterator into a bounded queue, ends the queue with a
        sentinel at the epoch's end, and the loop trains one batch a step from the queue. How far the thread has read
        when the model trains or a save runs is a matter of timing."""
        for batch in prefetched(self.a, self.p.depth):
            self._query()
            self._train(epoch, batch)
            self._maybe_save()

    def _query(self) -> None:
        """On one rank only, every query of both loaders: a log line's reads must change nothing anywhere.

        All but ``dl.epoch``, whose answer right after a resume between two epochs is the documented signal that
        the loop re-enters the finished epoch (``docs/lifecycle.md``): asked on one rank only there, it makes
        that rank re-enter alone, which this generator found (a hang in DDP's all-reduce) and which stays open.
        """
        if self.p.query_rank != self.rank:
            return
        for dl in (self.a, self.b):
            _ = (dl.batches_yielded, dl.phase, repr(dl), dl.state_dict(), len(dl), dl.progress(),
                 dl.end_of_dataloader, dl.skipped_samples)

    def _eval_at_top(self) -> None:
        """An evaluation at the top of a step, after its training batch was drawn, cut short by ``break``."""
        every = self.p.eval_top_every
        if every and self.ctr.step % every == 0:
            for i, batch in enumerate(self.b):
                self._query()
                self.trace.append(("top-eval", batch.tolist()))
                if i >= 1:
                    break

    def _truncated(self) -> bool:
        return self.p.limit is not None and self.ctr.in_epoch >= self.p.limit

    def _train(self, epoch: int, batch: Any, other: Any = None) -> None:
        acc, ctr = self.acc, self.ctr
        with acc.accumulate(self.model):
            x = batch.float().view(-1, 1) / 100  # ids up to ~50 at lr 0.01 made the weights diverge to NaN
            if other is not None:
                x = torch.cat([x, other.float().view(-1, 1) / 100])
            loss = (self.model(x) ** 2).mean()
            acc.backward(loss)
            self.optimizer.step()
            self.optimizer.zero_grad()
        tag = "A" if other is None else "A+B"
        extra = [] if other is None else other.tolist()
        self.trace.append((tag, epoch, batch.tolist(), extra, acc.sync_gradients))
        ctr.in_epoch += 1
        ctr.step += 1
        if self.p.gc_every_rank == self.rank and ctr.step % 3 == 0:
            gc.collect()

    def _maybe_save(self) -> None:
        """At the end of a step (all of its work done), as a loop that resumes must save."""
        if self.ctr.step % self.p.save_every == self.p.save_offset:
            self._save()

    def _evaluate(self, steps: int) -> None:
        for i, batch in enumerate(self.b):
            self._query()
            self.trace.append(("eval", batch.tolist(), self.b.end_of_dataloader))
            if i + 1 >= steps:
                break

    def _save(self) -> None:
        folder = self.root / f"save_{self.ctr.saves}"
        self.ctr.saves += 1
        self.acc.save_state(str(folder))
        self.saves.append((self.ctr.saves - 1, len(self.trace), folder))


def _fresh(accelerator: Any) -> None:
    """A new program start in this process: nothing prepared, nothing registered, no loader active."""
    accelerator._models, accelerator._optimizers, accelerator._schedulers = [], [], []
    accelerator._dataloaders, accelerator._custom_objects = [], []
    accelerator.step = 0
    GradientState().dataloader_references = [None]
    KEPT.clear()
    gc.collect()


def check(program: Program, accelerator: Any, root: Path, rank: int, picks: int = 3) -> list[str]:
    """Run ``program`` uninterrupted, then resumed from some of its saves (and once from a resumed run's
    save); returns the differences found (empty: exact). A program that must be refused returns the
    refusal's text as its only entry, prefixed with ``refused:``."""
    rng = random.Random(program.seed * 7 + 1)
    shutil.rmtree(root, ignore_errors=True)
    try:
        reference = Run(program, accelerator, root / "reference", rank)()
    except Exception as exc:  # noqa: BLE001 (returned to the caller, which compares it across ranks)
        if program.refused:
            return [f"refused: {type(exc).__name__}: {exc}"]
        raise
    if program.refused:
        return ["a save with an iterator kept on one rank only was not refused"]
    found = []
    if program.query_rank is not None:  # the queries change nothing: the same run without them, entry for entry
        quiet = Run(replace(program, query_rank=None), accelerator, root / "quiet", rank)()
        if quiet.trace != reference.trace:
            found.append(_difference(f"the queries on rank {program.query_rank} changed the run", quiet.trace, 0,
                                     reference.trace))
    chosen = rng.sample(reference.saves, min(picks, len(reference.saves)))
    for number, at, folder in chosen:
        resumed = Run(program, accelerator, root / f"resumed_{number}", rank, resume_from=folder)()
        if reference.trace[:at] + resumed.trace != reference.trace:
            found.append(_difference(f"resumed from save {number}", reference.trace, at, resumed.trace))
            continue
        later = [s for s in resumed.saves if s[0] > number]
        if later:
            again_number, again_at, again_folder = rng.choice(later)
            chained = Run(program, accelerator, root / f"chained_{number}", rank, resume_from=again_folder)()
            prefix = reference.trace[:at] + resumed.trace[:again_at]
            if prefix + chained.trace != reference.trace:
                found.append(_difference(f"resumed from save {number}, then from its save {again_number}",
                                         reference.trace, len(prefix), chained.trace))
    return found


def _difference(what: str, reference: list, at: int, resumed: list) -> str:
    expected = reference[at:]
    index = next((i for i, (x, y) in enumerate(zip(expected, resumed)) if x != y), min(len(expected), len(resumed)))
    return (f"{what}: at trace entry {at + index}, expected {expected[index:index + 3]}, got "
            f"{resumed[index:index + 3]} ({len(expected)} entries expected after the save, {len(resumed)} got)")


def prefetched(loader: Any, depth: int) -> Any:
    """``loader``'s batches as a prefetcher thread hands them over: the thread calls ``next()`` into a
    ``queue.Queue(maxsize=depth)`` and ends it with a sentinel at the epoch's end."""
    it, batches, end = iter(loader), queue.Queue(maxsize=depth), object()

    def fill() -> None:
        try:
            for batch in it:
                batches.put(batch)
        finally:
            batches.put(end)

    thread = threading.Thread(target=fill, daemon=True)
    thread.start()
    while (batch := batches.get()) is not end:
        yield batch
    thread.join()
