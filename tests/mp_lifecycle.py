"""Rank side of ``test_lifecycle_mp.py``: generated programs on real processes (gloo), one launch.

Usage: ``accelerate launch ... tests/mp_lifecycle.py OUT_DIR FIRST_SEED COUNT REFUSALS``. Every rank runs the
same programs (``lifecycle_programs.draw``), with the rank-specific parts each program draws (a caught exception
kept on one rank, the garbage collector off or run often on one rank, an iterator kept on one rank only), and
writes ``rank<r>.json``: per program, the differences its resumes found (none expected) or the refusal it met
(expected, and the same on every rank, for the programs that keep an iterator on one rank only).
"""

from __future__ import annotations

import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from accelerate.utils import DataLoaderConfiguration, broadcast_object_list

sys.path.insert(0, str(Path(__file__).parent))

import lifecycle_programs as programs  # noqa: E402
import mp_harness_rank  # noqa: E402
from accelerate_stateful import Accelerator  # noqa: E402


def main(out_dir: Path, first: int, count: int, refusals: int) -> None:
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2,
                              dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    rank, world = accelerator.process_index, accelerator.num_processes
    gc.collect()
    gc.freeze()  # the import-time heap: each save's full collection then scans what the programs make
    drawn = [programs.draw(seed, world) for seed in range(first, first + count)]
    drawn += [programs.draw(seed, world, refusal=True) for seed in range(first, first + refusals)]
    box = [tempfile.mkdtemp(prefix="lifecycle_", dir=out_dir)] if rank == 0 else [None]
    broadcast_object_list(box)  # one folder every rank saves into, as a shared file system
    root = Path(box[0])
    results = []
    for program in drawn:
        started = time.perf_counter()
        found = programs.check(program, accelerator, root / f"p{program.seed}{'r' if program.refused else ''}", rank)
        results.append({"seed": program.seed, "refusal_expected": program.refused, "found": found,
                        "program": program.describe(), "seconds": round(time.perf_counter() - started, 2)})
        gc.collect()
        gc.freeze()  # what the first program imported lazily, set aside too (a save's collection scans the rest)
        (out_dir / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
        if rank == 0:
            print(f"program {program.seed}{' (refusal)' if program.refused else ''}: "
                  f"{'ok' if not found or program.refused else 'DIFFERS'} ({results[-1]['seconds']} s)", flush=True)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    mp_harness_rank.run(main, Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
