"""``examples/train.py`` with knobs for the torture and shutdown tests: ``total_limit``, a save window, a failing rank.

Usage::

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 tests/torture_train.py \
        --out DIR --total-limit 1 --save-sleep 0.05 [any examples/train.py option]

It runs the example's own ``run()`` (dataset, loader, training loop, the
per-rank JSON-lines stream that ``examples/demo.py`` verifies), with these knobs:

- ``--total-limit``: checkpoints kept (the example keeps 3); with 1, every save
  deletes the previous checkpoint, once the new one is complete.
- ``--save-sleep``: seconds spent inside ``save_state`` (in the ``state_dict()``
  of the object registered for checkpointing, after Accelerate wrote the model
  and optimizer and before the loader states and the manifest), so that a kill
  aimed at a save lands inside one however fast the disk is.
- ``--lr``: the example's 0.05 diverges to NaN after about 90 steps of batch 4,
  and NaN losses never compare equal.
- ``--raise-at-step`` / ``--raise-on-rank``: that rank raises in the middle of
  the epoch, right after logging that step (``test_shutdown.py`` checks that
  the whole job then ends, instead of the other rank waiting in a collective).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import train  # noqa: E402  (examples/train.py)
from accelerate_stateful import Accelerator  # noqa: E402


class SlowProgress(train.Progress):
    """The example's step counter, whose checkpointing takes ``delay`` seconds."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def state_dict(self) -> dict[str, int]:
        time.sleep(self.delay)
        return super().state_dict()


def parse_args(argv: Optional[list[str]] = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    parser.add_argument("--total-limit", type=int, default=1)
    parser.add_argument("--save-sleep", type=float, default=0.0)
    parser.add_argument("--lr", type=float, default=0.05, help="the example's; long runs need less to stay finite")
    parser.add_argument("--raise-at-step", type=int, default=0, help="0: never")
    parser.add_argument("--raise-on-rank", type=int, default=1)
    ours, rest = parser.parse_known_args(argv)
    return ours, train.parse_args(rest)


def main(argv: Optional[list[str]] = None) -> None:
    ours, args = parse_args(argv)

    def fail_on_purpose(accelerator: Accelerator, step: int) -> None:
        if step == ours.raise_at_step and accelerator.process_index == ours.raise_on_rank:
            raise RuntimeError(f"rank {ours.raise_on_rank} fails at step {step} (--raise-at-step)")

    train.run(args, total_limit=ours.total_limit, lr=ours.lr, progress=SlowProgress(ours.save_sleep),
              after_step=fail_on_purpose)


if __name__ == "__main__":
    # Stacks on demand for the harness's watchdog, but not its fail-fast exit: how a rank that raises ends the
    # job is what test_shutdown.py tests, through the example's own code.
    import mp_harness_rank

    mp_harness_rank.install_stack_dump()
    main()
