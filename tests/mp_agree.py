"""Launched on 2 processes by ``test_agree_mp.py``: whatever defines the data is agreed once, on every rank.

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 tests/mp_agree.py OUT

Each rank writes ``OUT/rank<R>.json``: per scenario ``id``, ``passed``, ``detail``.
"""

from __future__ import annotations

import datetime
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate.state import PartialState
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader, IterableDataset

from accelerate_stateful import Accelerator
from accelerate_stateful.errors import StatefulLoaderError, UnsupportedConfigError
from accelerate_stateful.sources import Mixture
import mp_harness_rank
from mp_failures import Failed, check, everyone  # the one-rank-failure launch's helpers


def make(**config: Any) -> Accelerator:
    return Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True, **config))


def a_per_rank_generator_seed_is_agreed_at_prepare(out: Path, rank: int) -> Any:
    accelerator = make()
    dl = accelerator.prepare(DataLoader(list(range(16)), batch_size=2, shuffle=True,
                                        generator=torch.Generator().manual_seed(1000 + rank)))
    mine = [int(x) for batch in dl for x in batch]
    seen = everyone(mine)
    every = sorted(x for ids in seen for x in ids)
    check(every == list(range(16)), f"each sample once across the ranks, got {seen}")
    check(dl.seed == 1000, f"rank 0's seed wins, as in Accelerate: {dl.seed}")
    return seen


def weights_set_on_one_rank_are_refused_at_save_on_every_rank(out: Path, rank: int) -> Any:
    accelerator = make(dispatch_batches=False)
    mix = Mixture({"a": list(range(40)), "b": list(range(100, 140))}, {"a": 1, "b": 1}, seed=3)
    dl = accelerator.prepare(DataLoader(mix, batch_size=2))
    if rank == 0:
        mix.set_weights({"a": 3, "b": 1})
    for _, _ in zip(range(2), dl):
        pass
    try:
        accelerator.save_state(str(out / "ckpt"))
    except UnsupportedConfigError as exc:
        message = str(exc)
    else:
        raise Failed("the save was sealed with different weights on the ranks")
    check("weights of Mixture is not the same on every process" in message and "{a: 3, b: 1}" in message
          and "call set_weights with the same weights on every process" in message, message)
    check(len(set(everyone(message))) == 1, "the same refusal on every rank")
    return message


class FailsAt(IterableDataset):
    """A stream whose reading raises at item ``at`` (only the main process reads it under the dispatcher)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def __iter__(self):
        for i in range(self.at):
            yield i
        raise UnsupportedConfigError(f"the source cannot go on past item {self.at}: give it more items")


def a_readers_error_under_the_dispatcher_is_raised_on_every_rank(out: Path, rank: int) -> Any:
    accelerator = make(dispatch_batches=True)
    dl = accelerator.prepare(DataLoader(FailsAt(9), batch_size=2))
    taken = 0
    try:
        for _ in dl:
            taken += 1
    except StatefulLoaderError as exc:
        found = (type(exc).__name__, str(exc), taken)
    else:
        raise Failed("no error on this rank")
    seen = everyone(found)
    check(len(set(seen)) == 1, f"the same class, message and step on every rank: {seen}")
    check(found[0] == "UnsupportedConfigError" and "past item 9" in found[1], f"{found}")
    return found


SCENARIOS = {
    "per-rank-generator-seed-agreed": a_per_rank_generator_seed_is_agreed_at_prepare,
    "weights-on-one-rank-refused-at-save": weights_set_on_one_rank_are_refused_at_save_on_every_rank,
    "dispatcher-reader-error-on-every-rank": a_readers_error_under_the_dispatcher_is_raised_on_every_rank,
}


def main() -> None:
    out = Path(sys.argv[1])
    state = PartialState(cpu=True, timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    results = []
    for name in sys.argv[2:] or list(SCENARIOS):
        mp_harness_rank.set_aside()
        dist.barrier()
        try:
            results.append({"id": name, "passed": True, "detail": SCENARIOS[name](out / name, state.process_index)})
        except Exception as exc:  # recorded for the test to print, then every rank ends (mp_harness_rank.run)
            results.append({"id": name, "passed": False, "detail": f"{exc!r}\n{traceback.format_exc()}"})
            raise
        finally:
            (out / f"rank{state.process_index}.json").write_text(json.dumps(results, indent=1, default=str))
    dist.barrier()


if __name__ == "__main__":
    mp_harness_rank.run(main)
