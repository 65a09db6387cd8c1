"""What each run of ``check-resume`` runs: the user's command, on the processes and workers of its turn.

``--workers 0,2`` and ``--processes 2,3`` cycle the runs of a chain through counts: run ``k`` (from 1) of a
chain uses the ``(k - 1) % len``-th, the uninterrupted run the first. The worker count reaches the script through
``ACCELERATE_STATEFUL_NUM_WORKERS``, which ``Accelerator.prepare`` reads (``training/_check_workers.py``); the
process count is written into the command's launcher option (``accelerate launch --num_processes N``,
``torchrun --nproc_per_node N``), which must be there to be rewritten.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Optional

from ..training._record_switch import WORKERS_ENV


ACCELERATE, TORCHRUN = ("--num_processes", "--num-processes"), ("--nproc_per_node", "--nproc-per-node")
LAUNCHERS = {"accelerate": ACCELERATE, "accelerate.commands.launch": ACCELERATE,  # python -m accelerate.commands...
             "torchrun": TORCHRUN, "torch.distributed.run": TORCHRUN}


def counts(text: str, least: int = 0, what: str = "worker counts", example: str = "0,2") -> list[int]:
    """``--workers 0,2``: whole numbers, ``least`` or more, separated by commas."""
    try:
        values = [int(s) for s in text.split(",")]
    except ValueError:
        values = [least - 1]
    if any(v < least for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give {what} ({least} or more) separated by commas, e.g. {example}")
    return values


def process_counts(text: str) -> list[int]:
    """``--processes 2,3``: whole numbers, 1 or more, separated by commas."""
    return counts(text, 1, "process counts", "2,3")


def with_processes(command: list, count: int) -> list:
    """``command`` with its launcher's process count replaced by ``count``; ValueError, in the user's terms, when
    it is neither ``accelerate launch ... --num_processes N`` nor ``torchrun ... --nproc_per_node N``."""
    words = [str(w) for w in command]
    names = [os.path.basename(w) for w in words]
    for launcher, options in LAUNCHERS.items():
        if launcher not in names:
            continue
        start = names.index(launcher)
        for i in range(start + 1, len(words)):
            word = words[i]
            if word in options and i + 1 < len(words):
                return words[:i + 1] + [str(count)] + words[i + 2:]
            if word.split("=", 1)[0] in options and "=" in word:
                return words[:i] + [f"{word.split('=', 1)[0]}={count}"] + words[i + 1:]
        raise ValueError(f"--processes: the command's {launcher} has no {options[0]} N to change: write it out, "
                         f"e.g. {'accelerate launch' if options is ACCELERATE else 'torchrun'} {options[0]} 2 ...")
    raise ValueError("--processes changes the process count of an 'accelerate launch --num_processes N ...' or "
                     "'torchrun --nproc_per_node N ...' command; this command is neither: launch the script with "
                     "one of them, or leave out --processes")


@dataclass(frozen=True)
class Variant:
    """One run's command, the environment it adds, and how the run lines describe it (empty: nothing varies)."""

    command: list
    env: dict
    label: str


@dataclass(frozen=True)
class Setup:
    """The user's command and what ``--workers`` and ``--processes`` vary between runs."""

    command: list
    workers: Optional[list] = None
    processes: Optional[list] = None

    def variant(self, number: int) -> Variant:
        """Run ``number`` of a chain (from 1; the uninterrupted run is run 1 too)."""
        command, env, label = self.command, {}, []
        if self.processes:
            count = self.processes[(number - 1) % len(self.processes)]
            command = with_processes(command, count)
            label.append(f"{count} process(es)")
        if self.workers:
            count = self.workers[(number - 1) % len(self.workers)]
            env[WORKERS_ENV] = str(count)
            label.append(f"{count} DataLoader worker(s)")
        return Variant(command, env, " and ".join(label))
