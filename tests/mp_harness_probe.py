"""Rank side of ``test_mp_harness.py``: the two ways a launch goes wrong, on 2 real processes (gloo).

    accelerate launch --multi_gpu --num_processes 2 tests/mp_harness_probe.py MODE

``env``: each rank writes what it was started with (its environment's launcher variables, ``sys.argv``,
``sys.path[0]``, its session) to ``OUT/rank<R>.json`` and both end normally.
``raise``: rank 1 raises in ``rank_one_raises_here`` while rank 0 waits in a barrier that rank 1 never reaches.
``block``: rank 1 waits for a batch from its one DataLoader worker, which never returns from
``worker_blocks_here``; rank 0 waits in a barrier. The collective timeout (300 s) is far beyond the test's
watchdog, so only the harness can end either launch.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).parent))
import mp_harness_rank  # noqa: E402


class BlockingDataset(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        worker_blocks_here()
        return index


def worker_blocks_here() -> None:
    print("worker: blocked", flush=True)
    while True:
        time.sleep(1)


def rank_one_raises_here() -> None:
    raise ValueError("rank 1 fails on purpose")


def rank_one_waits_here() -> None:
    next(iter(DataLoader(BlockingDataset(), num_workers=1)))


# The variables a launcher gives a rank (their values are compared where they do not name a port or a run).
STARTED_WITH = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
                "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS", "PYTHONPATH")


def describe(out: str) -> None:
    import numpy

    found = {k: v for k, v in os.environ.items() if k in STARTED_WITH or k.startswith("ACCELERATE_")}
    rank = int(os.environ.get("RANK", "0"))
    record = {"env": found, "argv": sys.argv, "path0": sys.path[0], "own_session": os.getsid(0) == os.getpid(),
              "main": __name__, "numpy": int(numpy.random.randint(1 << 30))}
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))


def main(mode: str, *args: str) -> None:
    if mode == "env":
        describe(args[0])
        return
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    dist.barrier()
    if dist.get_rank() == 1:
        rank_one_raises_here() if mode == "raise" else rank_one_waits_here()
    print(f"rank {dist.get_rank()}: in a barrier", flush=True)
    dist.barrier()


if __name__ == "__main__":
    mp_harness_rank.run(main, *sys.argv[1:])
