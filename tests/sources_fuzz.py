"""Random composable pipelines resumed through random chains of topologies: nothing lost, nothing extra.

Each case draws a pipeline of the package's sources (``Mixture`` with constant weights, ``Stages`` or a
``Ramp``, ``Filtered``, ``Shuffled``, ``Packed`` with either ending, nested in the ways users nest them), loader
settings (batch size, ``drop_last``, ``split_batches``), and a chain of 2 to 4 launches, each on its own
(processes, workers), some with another batch size, each taking a random number of steps before it saves;
the last runs to the end of the second epoch. Ranks are simulated in one process (every rank reads the whole
stream and keeps its slice) and a resume takes its state as ``accelerate.load_state`` gives it
(``checkpoint._resume.shared_state``: each rank its own on the saved world size, else the merged or the main
process's), through the on-disk format.

Checked per epoch, against the same pipeline read item by item without a loader: no item the run delivered
is foreign to the epoch; none is missing (but the last global batch ``drop_last`` drops); none comes more
often than the first launch's own topology repeats it, plus one padded global batch. A chain that never
changes its topology or batch size must deliver the uninterrupted run's sequence, rank for rank. A resume
the package refuses (another ``split_batches``, another batch size inside an epoch without ``drop_last``)
must refuse with one of its own errors, which is counted, not failed.

``tests/test_sources_fuzz.py`` runs a few cases in the suite; ``make soak`` runs many::

    python tests/sources_fuzz.py --cases 300 --seed 0
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
from typing import Any, Optional

import torch
from torch.utils.data import DataLoader

from accelerate_stateful import DistContext, IterableShardDataLoader
from accelerate_stateful.checkpoint._resume import shared_state
from accelerate_stateful.errors import StatefulLoaderError
from accelerate_stateful.sources import Filtered, Mixture, Packed, Shuffled
from accelerate_stateful.sources.schedule import Ramp, Stages

from harness import through_files

EPOCHS = 2
TOPS = ("leaf", "mixture", "filter-over", "shuffle-over")


def keep_two_thirds(item: Any) -> bool:
    return _first(item) % 3 != 0


def keep_six_in_ten(item: Any) -> bool:
    return (_first(item) * 7919) % 10 < 6


def _first(item: Any) -> int:
    return item["input_ids"][0] if isinstance(item, dict) else item


def _documents(base: int, n: int) -> list[dict]:
    """Documents of 1 to 4 tokens, every token of every source distinct (``10 * id + position``)."""
    return [{"input_ids": [(base + i) * 10 + j for j in range(1 + (base + i) % 4)]} for i in range(n)]


def build(spec: dict) -> Any:
    """The case's pipeline, the same objects for the same ``spec`` on every call."""
    rnd = random.Random(spec["seed"])

    def leaf(base: int) -> Any:
        items = _documents(base, spec["n"]) if spec["packed"] else list(range(base, base + spec["n"]))
        kind = rnd.choice(["plain", "filter", "shuffle", "filter-shuffle"])
        if kind == "filter":
            return Filtered(items, rnd.choice([keep_two_thirds, keep_six_in_ten]))
        if kind == "shuffle":
            return Shuffled(items, rnd.choice([3, 7]), seed=rnd.randrange(9))
        if kind == "filter-shuffle":
            return Shuffled(Filtered(items, keep_two_thirds), 4, seed=1)
        return items

    if spec["top"] == "leaf":
        pipeline = leaf(1)
        if isinstance(pipeline, list):  # a bare list is read whole by every DataLoader worker
            pipeline = Shuffled(pipeline, 1)
    else:
        sources = {"a": leaf(1), "b": leaf(1001), "c": leaf(2001)}
        weights = rnd.choice([
            {"a": 3, "b": 2, "c": 1},
            Stages([(0, {"a": 1, "b": 1, "c": 0}), (rnd.randrange(5, 40), {"a": 0, "b": 1, "c": 2})]),
            Stages([(0, {"a": 1, "b": 0, "c": 1}),
                    (10, Ramp(10, 50, {"a": 1, "b": 0, "c": 1}, {"a": 0, "b": 2, "c": 1}, block=4))]),
        ])
        restart = rnd.random() < 0.5
        pipeline = Mixture(sources, weights, seed=rnd.randrange(99), on_exhausted="restart" if restart else "stop",
                           samples_per_epoch=2 * spec["n"] if restart else None)
        if spec["top"] == "filter-over":
            pipeline = Filtered(pipeline, keep_six_in_ten)
        elif spec["top"] == "shuffle-over":
            pipeline = Shuffled(pipeline, 5, seed=2)
    if spec["packed"]:
        pipeline = Packed(pipeline, seq_len=spec["seq_len"], last=spec["last"])
    return pipeline


def collate(rows: list) -> list:
    """A batch as hashable items: ints, or a packed row's tokens as a tuple."""
    return [tuple(int(t) for t in row["input_ids"]) if isinstance(row, dict) else int(row) for row in rows]


def make(spec: dict, world: int, rank: int, workers: int, batch: Optional[int] = None,
         drop_last: Optional[bool] = None, split: Optional[bool] = None) -> IterableShardDataLoader:
    batch = batch or spec["batch"]
    dl = DataLoader(build(spec), batch_size=batch, num_workers=workers, collate_fn=collate,
                    drop_last=spec["drop_last"] if drop_last is None else drop_last)
    split = (spec["split"] if split is None else split) and batch % world == 0
    return IterableShardDataLoader.from_dataloader(dl, DistContext(rank, world), split_batches=split)


def run_launch(loaders: list, stop: Optional[int]) -> tuple[dict, bool]:
    """Every rank in lockstep for ``stop`` steps (``None``: to the end of the last epoch): the items by epoch
    (every rank's, in rank order per step), and whether it stopped before the end."""
    got: dict = collections.defaultdict(list)
    taken = 0
    for epoch in range(loaders[0].epoch, EPOCHS):
        passes = [iter(dl) for dl in loaders]
        while True:
            if taken == stop:
                return got, True
            batches = [next(p, None) for p in passes]
            if all(b is None for b in batches):
                break
            if any(b is None for b in batches):
                raise AssertionError(f"the ranks went out of step in epoch {epoch}")
            got[epoch] += [item for batch in batches for item in batch]
            taken += 1
    return got, False


def check(spec: dict, chain: list) -> list[str]:
    """The chain's problems (empty: none). ``chain``: ``(world, workers, steps, batch)`` per launch."""
    def topology(link: tuple) -> tuple:
        return link[0], link[1], link[3] or spec["batch"]

    first = chain[0]
    reference = run_launch([make(spec, first[0], r, first[1], first[3]) for r in range(first[0])], None)[0]
    every = run_launch([make(spec, 1, 0, 0, batch=1, drop_last=False, split=False)], None)[0]
    seen: dict = collections.defaultdict(list)
    states: Optional[list] = None
    saved_world = None
    for world, workers, steps, batch in chain:
        loaders = [make(spec, world, rank, workers, batch) for rank in range(world)]
        if states is not None:
            for rank, loader in enumerate(loaders):
                own = states[rank] if saved_world == world else None
                shared = shared_state(loader, own, states[0], lambda: list(states))
                loader.load_state_dict(shared if shared is not None else own)
        got, stopped = run_launch(loaders, steps)
        for epoch, items in got.items():
            seen[epoch] += items
        if not stopped:
            break
        states = [through_files(loader.state_dict(), rank) for rank, loader in enumerate(loaders)]
        saved_world = world
    problems = []
    padding = max(link[0] * (link[3] or spec["batch"]) for link in chain)
    unchanged = all(topology(link) == topology(first) for link in chain)
    for epoch in range(EPOCHS):
        delivered, whole = collections.Counter(seen[epoch]), set(every[epoch])
        foreign, missing = set(delivered) - whole, whole - set(delivered)
        if foreign or len(missing) > (padding if spec["drop_last"] else 0):
            problems.append(f"epoch {epoch}: {len(missing)} missing {sorted(missing, key=str)[:6]}, "
                            f"{len(foreign)} foreign {sorted(foreign, key=str)[:6]}")
        repeated = sum(delivered.values()) - len(delivered)
        allowed = len(reference[epoch]) - len(set(reference[epoch])) + padding
        if repeated > allowed:
            problems.append(f"epoch {epoch}: {repeated} repeated, at most {allowed} due")
        if unchanged and seen[epoch] != reference[epoch]:
            problems.append(f"epoch {epoch}: resumed on its own topology, not the uninterrupted run's sequence")
    return problems


def draw_case(seed: int) -> tuple[dict, list]:
    rnd = random.Random(seed)
    spec = {"seed": rnd.randrange(10 ** 6), "packed": rnd.random() < 0.4, "n": rnd.choice([17, 30, 45]),
            "top": rnd.choice(TOPS), "batch": rnd.choice([2, 3, 4]), "seq_len": rnd.choice([3, 5]),
            "last": rnd.choice(["drop", "pad"]), "drop_last": rnd.random() < 0.3, "split": rnd.random() < 0.2}
    unchanged = rnd.random() < 0.25
    chain = []
    for _ in range(rnd.choice([2, 3, 4])):
        if unchanged:
            chain.append((2, 1, rnd.randrange(1, 12), None))
        else:
            batch = rnd.choice([2, 3, 4, 6]) if rnd.random() < 0.3 else None
            chain.append((rnd.choice([1, 2, 3]), rnd.choice([0, 0, 1, 2]), rnd.randrange(1, 12), batch))
    chain[-1] = (*chain[-1][:2], None, chain[-1][3])
    return spec, chain


def run_cases(cases: int, seed: int, workers: bool = True, out=sys.stdout) -> tuple[int, int]:
    """``(failed, refused)`` over ``cases`` drawn cases (``workers=False``: every launch without workers)."""
    failed = refused = 0
    for case in range(seed, seed + cases):
        spec, chain = draw_case(case)
        if not workers:
            chain = [(world, 0, steps, batch) for world, _, steps, batch in chain]
        try:
            problems = check(spec, chain)
        except StatefulLoaderError as exc:  # the package's own refusal, before any batch of the resume
            refused += 1
            print(f"case {case}: refused: {str(exc).splitlines()[0][:160]}", file=out)
            continue
        except Exception as exc:  # anything else is a failure of the case, reported with the rest
            problems = [f"raised {type(exc).__name__}: {exc}"]
        if problems:
            failed += 1
            print(f"case {case} FAILED: {spec} {chain}", *(f"    {p}" for p in problems), sep="\n", file=out)
    return failed, refused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0, help="the first case's number (default 0)")
    args = parser.parse_args()
    failed, refused = run_cases(args.cases, args.seed)
    print(f"{args.cases} cases: {failed} failed, {refused} refused by the package, "
          f"{args.cases - failed - refused} exact")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
