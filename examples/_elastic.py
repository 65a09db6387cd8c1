"""The demo's elastic check: a run killed on W processes and resumed on W' keeps the package's promise.

The resumed run's batches must equal, rank by rank, an in-process simulation of
the same chain: ``ShardDataLoader`` on simulated ranks, same dataset, seed and
batch size, loading the checkpoint's own loader state. The promise itself is
also checked on the real streams, so that a simulation sharing a bug with the
package cannot hide it:

- in the interrupted epoch every sample not consumed before the checkpoint is
  delivered exactly once across the new ranks, and none consumed before comes
  back except Accelerate's end-of-epoch padding: the epoch's first samples,
  repeated to complete the last step (``even_batches``), exactly as many as the
  new striping needs (:class:`ShardPlan`'s ``padding``);
- every later epoch is, on every rank, what a fresh run on W' processes trains.
"""

from __future__ import annotations

import collections
import copy
import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

from _verify import MISSED, NOT_APPLICABLE, REJECTED, Attempt, effective_stream, read_stream
from accelerate_stateful import DistContext, ShardDataLoader, ShardPlan
from accelerate_stateful.checkpoint._files import read_loader_state

# The package's WARNING on a resume with another topology (accelerate_stateful.accelerator._log_resume).
TOPOLOGY_LOG = re.compile(r"loader 0: resuming epoch (\d+) at \S+ on (\d+) ranks x (\d+) workers \(was (\d+) x (\d+)\)")


class Batch(NamedTuple):
    """One rank's batch: its epoch, its index in the epoch's pass on this world size, its sample ids."""

    epoch: int
    batch: int
    ids: list[int]


class Checkpoint(NamedTuple):
    """Where the checkpoint the resume loaded stopped, from rank 0's loader state."""

    name: str
    epoch: int
    consumed: int
    world: int
    workers: int
    num_samples: int


@dataclass
class Simulation:
    """The chain replayed in one process; each list holds one list of batches per rank."""

    old: list[list[Batch]]  # on the saving world size, from the start up to the checkpoint
    new: list[list[Batch]]  # on the new world size, from the checkpoint to the end
    fresh: list[list[Batch]]  # on the new world size, a fresh run's epochs after the interrupted one
    padding: int  # samples the new striping repeats to complete the interrupted epoch's last step


def read_states(checkpoint: Path) -> tuple[Checkpoint, list[dict]]:
    """The checkpoint's loader-0 state of every saved rank (read before rotation may delete the folder)."""
    first = read_loader_state(checkpoint, 0, 0)
    topology = first["topology"]
    states = [first] + [read_loader_state(checkpoint, 0, r) for r in range(1, topology["world_size"])]
    return Checkpoint(checkpoint.name, first["epoch"], first["samples_consumed"], topology["world_size"],
                      topology["num_workers"], first["config"]["num_samples"]), states


def simulate(make_loader: Callable[[], Any], states: list[dict], new_world: int, epochs: int) -> Simulation:
    """Every rank's batches, old and new, from ``ShardDataLoader`` on ranks simulated in this process."""
    epoch, config = states[0]["epoch"], states[0]["config"]

    def loader(rank: int, world: int) -> ShardDataLoader:
        return ShardDataLoader.from_dataloader(make_loader(), DistContext(rank, world))

    old = [_drain(loader(r, len(states)), epochs, stop=(epoch, state["batches_yielded"]))
           for r, state in enumerate(states)]
    new, fresh = [], []
    for rank in range(new_world):
        resumed, later = loader(rank, new_world), loader(rank, new_world)
        resumed.load_state_dict(states[0])  # as the package does on another world size: rank 0's state
        later.set_epoch(epoch + 1)
        new.append(_drain(resumed, epochs))
        fresh.append(_drain(later, epochs))
    plan = ShardPlan(num_samples=config["num_samples"], world_size=new_world, rank=0, drop_last=config["drop_last"],
                     batch_size=config["batch_size"] // (new_world if config["split_batches"] else 1),
                     even_batches=config["even_batches"] and new_world > 1, origin=states[0]["samples_consumed"])
    return Simulation(old, new, fresh, plan.padding)


def _drain(loader: ShardDataLoader, epochs: int, stop: Optional[tuple[int, int]] = None) -> list[Batch]:
    """The batches from the loader's position to the end of epoch ``epochs - 1``, or to ``stop`` (epoch, batch)."""
    got: list[Batch] = []
    while loader.epoch < epochs and (loader.epoch, loader.batches_yielded) != stop:
        epoch = loader.epoch
        for batch in loader:
            got.append(Batch(epoch, loader.batches_yielded - 1, batch["id"].tolist()))
            if (epoch, loader.batches_yielded) == stop:
                return got
    return got


# --------------------------------------------------------------------------- verifying
@dataclass
class ElasticVerdict:
    """The elastic resume's result: a line per rank, a line per epoch, and everything found wrong."""

    checkpoint: Checkpoint
    new_world: int
    lines: list[str]
    problems: list[str]
    log_line: Optional[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def read_streams(run: Path, ranks: int) -> list[list[Attempt]]:
    """Each rank's process starts; a rank that never ran has none."""
    return [read_stream(p) if (p := run / f"stream_rank{r}.jsonl").exists() else [] for r in range(ranks)]


def verify_elastic(streams: list[list[Attempt]], checkpoint: Checkpoint, sim: Simulation, log: str) -> ElasticVerdict:
    """Check the run killed on ``checkpoint.world`` processes and resumed on ``len(sim.new)`` (see module doc).

    Args:
        streams: Every rank's process starts (:func:`read_streams`); on each new rank the last one is the resume.
        checkpoint: What the resume loaded (:func:`read_states`).
        sim: The same chain simulated in one process (:func:`simulate`).
        log: What the resumed launch printed, where the package's topology WARNING must be.
    """
    new_world, problems, differences = len(sim.new), [], []
    old, new, lost = _split(streams, checkpoint, new_world, problems)
    lines = [_rank_line(rank, old[rank], new[rank], lost[rank], checkpoint, sim, differences)
             for rank in range(len(old))]
    lines.append(_interrupted_epoch(old, new, checkpoint, sim, problems))
    lines += _later_epochs(new, checkpoint, sim, problems)
    problems += differences  # after the promise's own checks, which do not lean on the simulation
    log_line = next((line.strip() for line in log.splitlines() if TOPOLOGY_LOG.search(line)), None)
    expected = (checkpoint.epoch, new_world, checkpoint.world, checkpoint.workers)
    match = TOPOLOGY_LOG.search(log_line or "")
    if match is None or tuple(int(match[i]) for i in (1, 2, 4, 5)) != expected:
        problems.append(f"the resumed run did not log 'resuming epoch {expected[0]} ... on {new_world} ranks ... "
                        f"(was {checkpoint.world} x {checkpoint.workers})'; it logged {log_line!r}")
    return ElasticVerdict(checkpoint, new_world, lines, problems, log_line)


def _split(streams: list[list[Attempt]], checkpoint: Checkpoint, new_world: int, problems: list[str]
           ) -> tuple[list[list[Batch]], list[list[Batch]], list[int]]:
    """Each rank's batches up to the checkpoint (old world size), after it (new), and how many the kill undid."""
    ranks = max(checkpoint.world, new_world, len(streams))
    streams = streams + [[] for _ in range(ranks - len(streams))]
    # On a new rank the last process start is the resume; a rank beyond the new world size has none.
    resumed = [attempts[-1:] if rank < new_world else [] for rank, attempts in enumerate(streams)]
    restored = {a.start["step"] for after in resumed for a in after}
    if len(restored) != 1:
        problems.append(f"the new ranks resumed at steps {sorted(restored)}, expected one step on all of them")
    last = max(restored, default=0)
    old, new, lost = [], [], []
    for rank, (attempts, after) in enumerate(zip(streams, resumed)):
        for attempt in after:
            start = attempt.start
            if (start["world_size"], start["resumed_from"]) != (new_world, checkpoint.name):
                problems.append(f"rank {rank}: last process start on {start['world_size']} processes from "
                                f"{start['resumed_from']}, expected {new_world} processes resuming {checkpoint.name}")
            steps = [line["step"] for line in attempt.batches]
            if steps != list(range(start["step"] + 1, start["step"] + 1 + len(steps))):
                problems.append(f"rank {rank}: the resumed run's steps do not continue from step {start['step']}")
        before = attempts[: len(attempts) - len(after)]
        if rank >= checkpoint.world and before:
            problems.append(f"rank {rank} trained before {checkpoint.name}, which {checkpoint.world} processes wrote")
        rank_problems: list[str] = []
        lines = effective_stream(before, rank_problems)[0]
        problems += [f"rank {rank}: {p}" for p in rank_problems]
        old.append([Batch(r["epoch"], r["batch"], r["ids"]) for r in lines if r["step"] <= last])
        new.append([Batch(r["epoch"], r["batch"], r["ids"]) for a in after for r in a.batches])
        lost.append(len(lines) - len(old[-1]))
    return old, new, lost


def _rank_line(rank: int, old: list[Batch], new: list[Batch], lost: int, checkpoint: Checkpoint, sim: Simulation,
               problems: list[str]) -> str:
    diffs = []
    for when, got, want in (("before", old, sim.old), ("after", new, sim.new)):
        diff = _first_difference(want[rank] if rank < len(want) else [], got)
        if diff:
            diffs.append(f"{when} the checkpoint, {diff}")
    problems += [f"rank {rank} differs from the simulation {diff}" for diff in diffs]
    per_epoch = collections.Counter(b.epoch for b in new)
    undone = f" (+{lost} trained after it, undone by the kill)" if lost else ""
    return (f"rank {rank}: {len(old)} batches up to {checkpoint.name} on {checkpoint.world} processes{undone}, "
            f"{len(new)} after it on {len(sim.new)} "
            f"({', '.join(f'epoch {e}: {k}' for e, k in sorted(per_epoch.items()))}): "
            + ("; ".join(diffs) if diffs else "IDENTICAL to the simulation"))


def _first_difference(want: list[Batch], got: list[Batch]) -> Optional[str]:
    for index, (w, g) in enumerate(zip(want, got)):
        if w != g:
            return f"batch {index}: (epoch, batch, ids) {tuple(g)} instead of {tuple(w)}"
    return None if len(want) == len(got) else f"{len(got)} batches instead of {len(want)}"


def _in_order(batches: list[list[Batch]], epoch: int) -> list[int]:
    """The epoch's ids in the order the striping takes them: step by step, rank by rank."""
    steps = sorted((b.batch, rank, b.ids) for rank, bs in enumerate(batches) for b in bs if b.epoch == epoch)
    return [i for _, _, ids in steps for i in ids]


def _interrupted_epoch(old: list[list[Batch]], new: list[list[Batch]], checkpoint: Checkpoint, sim: Simulation,
                       problems: list[str]) -> str:
    epoch, n, name = checkpoint.epoch, checkpoint.num_samples, checkpoint.name
    before, after = _in_order(old, epoch), _in_order(new, epoch)
    real, padding = after[: n - len(before)], after[n - len(before):]
    found = [
        (len(before) != checkpoint.consumed,
         f"{len(before)} samples trained before {name}, whose loader state says {checkpoint.consumed}"),
        (twice := sorted(i for i, k in collections.Counter(real).items() if k > 1),
         f"samples delivered more than once after the resume: {twice[:5]}"),
        (back := sorted(set(real) & set(before)), f"samples consumed before {name} delivered again: {back[:5]}"),
        (missing := sorted(set(range(n)) - set(before) - set(real)), f"samples never delivered: {missing[:5]}"),
        (padding != (first := (before + real)[: sim.padding]),
         f"end-of-epoch padding {padding}, expected the epoch's first {sim.padding} samples {first}"),
    ]
    failed = [f"epoch {epoch}: {text}" for failed, text in found if failed]
    problems += failed
    if failed:
        return f"epoch {epoch}, interrupted: {len(failed)} PROBLEMS"
    return (f"epoch {epoch}, interrupted: {len(before)}/{n} samples consumed before {name}; the other {len(real)} "
            f"delivered exactly once across {len(sim.new)} ranks; of the {len(before)}, none came back except "
            f"{len(padding)} of end-of-epoch padding {padding}, the epoch's first, as the new striping needs")


def _later_epochs(new: list[list[Batch]], checkpoint: Checkpoint, sim: Simulation, problems: list[str]) -> list[str]:
    notes, n = [], checkpoint.num_samples
    for epoch in sorted({b.epoch for bs in new + sim.fresh for b in bs if b.epoch > checkpoint.epoch}):
        got = [[b for b in bs if b.epoch == epoch] for bs in new]
        want = [[b for b in bs if b.epoch == epoch] for bs in sim.fresh]
        ids = [i for bs in got for b in bs for i in b.ids]
        differ = [r for r, (g, w) in enumerate(itertools.zip_longest(got, want, fillvalue=[])) if g != w]
        if differ or set(ids) != set(range(n)):
            problems.append(f"epoch {epoch}: ranks {differ} differ from a fresh {len(sim.new)}-process run's "
                            f"batches; {len(set(ids))}/{n} samples")
            continue
        notes.append(f"epoch {epoch}: every rank's batches equal a fresh {len(sim.new)}-process run's "
                     f"({len(set(ids))}/{n} samples, {len(ids) - len(set(ids))} of end-of-epoch padding)")
    return notes


def print_elastic(verdict: ElasticVerdict) -> None:
    c = verdict.checkpoint
    print(f"  {c.name} (written on {c.world} processes x {c.workers} workers): epoch {c.epoch}, {c.consumed} of "
          f"its {c.num_samples} samples consumed\n  package log: {verdict.log_line}")
    for line in verdict.lines:
        print(f"  {line}")
    for problem in verdict.problems:
        print(f"  PROBLEM {problem}")
    print("  ELASTIC OK" if verdict.ok else "  ELASTIC DIFFERENT")


# --------------------------------------------------------------------------- self-check
def _batches_after(streams: list[list[Attempt]], rank: int, epoch: int, later: bool) -> list[dict]:
    return [r for r in streams[rank][-1].batches if (r["epoch"] > epoch if later else r["epoch"] == epoch)]


def deliver_twice(streams: list[list[Attempt]], checkpoint: Checkpoint) -> bool:
    """Rank 1's first batch after the resume repeats a sample of rank 0's."""
    first, second = (_batches_after(streams, r, checkpoint.epoch, False) for r in (0, 1))
    if not first or not second:
        return False
    second[0]["ids"][0] = first[0]["ids"][0]
    return True


def bring_back_a_consumed_sample(streams: list[list[Attempt]], checkpoint: Checkpoint) -> bool:
    """A sample consumed before the checkpoint replaces one delivered after it."""
    consumed = [r for a in streams[0][:-1] for r in a.batches if r["epoch"] == checkpoint.epoch]
    after = _batches_after(streams, 0, checkpoint.epoch, False)
    if not consumed or not after:
        return False
    after[0]["ids"][0] = consumed[0]["ids"][0]
    return True


def swap_ranks_in_a_later_epoch(streams: list[list[Attempt]], checkpoint: Checkpoint) -> bool:
    """Ranks 0 and 1 trade their first batch of the next epoch."""
    first, second = (_batches_after(streams, r, checkpoint.epoch, True) for r in (0, 1))
    if not first or not second:
        return False
    first[0]["ids"], second[0]["ids"] = second[0]["ids"], first[0]["ids"]
    return True


PERTURBATIONS: dict[str, Callable[[list[list[Attempt]], Checkpoint], bool]] = {
    "a sample delivered on two new ranks": deliver_twice,
    "a consumed sample delivered again after the elastic resume": bring_back_a_consumed_sample,
    "two ranks' batches swapped in a later epoch": swap_ranks_in_a_later_epoch,
}


def self_check(streams: list[list[Attempt]], checkpoint: Checkpoint, sim: Simulation, log: str) -> dict[str, str]:
    """Damage copies of the elastic run's streams and verify each; maps each damage to its outcome."""
    outcomes = {}
    for name, perturb in PERTURBATIONS.items():
        damaged = copy.deepcopy(streams)
        if not perturb(damaged, checkpoint):
            outcomes[name] = NOT_APPLICABLE
            print(f"  self-check: {name}: {NOT_APPLICABLE} to this run")
            continue
        problems = verify_elastic(damaged, checkpoint, sim, log).problems
        outcomes[name] = REJECTED if problems else MISSED
        print(f"  self-check: {name}: {outcomes[name]}" + (f": {problems[0]}" if problems else ""))
    return outcomes
