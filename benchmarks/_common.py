"""What both benchmarks share: timing hygiene, the machine's description, markdown tables, JSON results."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import platform
import time
import warnings
from typing import Any, Callable, Iterator, Optional, Sequence

import accelerate
import torch
import torchdata

import accelerate_stateful


def abandon(loader: Any) -> None:
    """Tell Accelerate a loader we stopped early is done (its iterator has no ``finally``)."""
    end = getattr(loader, "end", None)
    if callable(end) and isinstance(loader, accelerate.data_loader.DataLoaderStateMixin):
        end()


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Keep the cycle collector out of a timed region, as ``timeit`` does (collected between rounds)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def rotated(items: Sequence, round_index: int) -> list:
    """``items`` started at a different one each round, so no contender always runs first."""
    shift = round_index % len(items)
    return list(items[shift:]) + list(items[:shift])


def environment() -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_model(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "accelerate": accelerate.__version__,
        "torchdata": torchdata.__version__,
        "accelerate_stateful": accelerate_stateful.__version__,
        "load average at start (1/5/15 min)": load_average(),
    }


def cpu_model() -> str:
    """The processor's name as the kernel reports it (``platform.processor()`` is often empty on Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:  # not Linux: the platform module's answer is the best there is
        pass
    return platform.processor() or platform.machine()


def load_average() -> str:
    """Other work on the machine shows up in every figure; the load average says how much there was."""
    return " / ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def jsonable(value: Any) -> Any:
    """Results as JSON takes them: dataclasses become dicts, mapping keys strings (``0.1`` -> ``"0.1"``)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    return value


def run_main(argv: Optional[Sequence[str]], doc: str, quick_note: str, sizes: tuple[dict, dict],
             measure: Callable[[dict, float], tuple[Callable[[dict], str], dict]]) -> int:
    """A benchmark's command line: ``--quick`` picks the first of ``sizes``, ``--markdown PATH`` saves the report,
    ``--json PATH`` the results (what ``benchmarks/plot.py`` draws).

    ``measure(sizes, started)`` runs the benchmark and returns what renders the report from the machine's
    description, completed with the load average at the end and the wall time, and the results.
    """
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"smaller sizes and fewer rounds ({quick_note})")
    parser.add_argument("--markdown", metavar="PATH", help="also write the tables as markdown to PATH")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
    env = environment()
    print("\n".join(f"{key}: {value}" for key, value in env.items()), flush=True)
    started = time.perf_counter()
    chosen = sizes[0] if args.quick else sizes[1]
    render, results = measure(chosen, started)
    env["load average at end (1/5/15 min)"] = load_average()
    env["benchmark wall time (s)"] = f"{time.perf_counter() - started:.0f}"
    report = render(env)
    print()
    print(report, flush=True)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as handle:
            handle.write(report)
    if args.json:
        document = {"environment": env, "sizes": chosen, "results": results}
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(jsonable(document), handle, indent=1)
    return 0
