"""Capture cost with 8 workers and a 10,000-item shuffle buffer (issue 28 §5.1): per batch, against a bare loader.

The dataset is the package's own composable shuffle buffer, ``Shuffled(list(range(n)), buffer_size=10_000)``,
read by ``num_workers=8`` DataLoader workers (each reads the whole sequence and keeps every 8th item, as the
composable sources do), ``batch_size=32``. The same dataset goes through each contender: a bare ``DataLoader``,
torchdata's ``StatefulDataLoader`` (default ``snapshot_every_n_steps=1``), stock Accelerate (``prepare`` with the
default configuration: its dispatcher), Accelerate with ``use_stateful_dataloader=True``, and ours (dispatcher,
and ``dispatch_batches=False``). Timing conventions are ``bench_stream.py``'s (one process, contenders rotated
each round, median of the rounds, first batch of a pass left out, wall and CPU per batch).

Besides time, one untimed pass per contender counts what reaches the main process per batch: the messages the
base loader's iterator takes from its workers' data queue and their size pickled, beyond what the bare
``DataLoader`` receives for the same batches, and the messages of our own worker channels (``_channels``:
instructions, state replies, a finished stream's ring).

    python benchmarks/bench_capture.py            # 7 to 10 minutes on 2 loaded cores
    python benchmarks/bench_capture.py --quick    # fewer batches and rounds
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import pickle
import resource
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

from torch.utils.data import dataloader as torch_dataloader
from torchdata.stateful_dataloader import stateful_dataloader as torchdata_loader

from torch.utils.data._utils.worker import WorkerInfo

from accelerate_stateful.loaders import _channels, _stream_rng
from accelerate_stateful.loaders._snapshot import DatasetPosition
from accelerate_stateful.sources import Shuffled
from accelerate_stateful.sources._global import shown_worker_info

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when a test loads this file
from _common import abandon, no_gc, rotated, run_main, table  # noqa: E402
from bench_stream import (  # noqa: E402
    ACC_DISPATCH, ACC_PLAIN, BARE, OURS_DISPATCH, OURS_SHARD, TORCHDATA, _accelerators, _build, _time_pass,
)

CONTENDERS = (BARE, TORCHDATA, ACC_PLAIN, ACC_DISPATCH, OURS_DISPATCH, OURS_SHARD)
FULL_SIZES = {"batch_size": 32, "num_workers": 8, "buffer_size": 10_000, "batches": 400, "rounds": 5}
QUICK_SIZES = {"batch_size": 32, "num_workers": 8, "buffer_size": 10_000, "batches": 120, "rounds": 2}


def stream(sizes: dict, batches: int) -> Shuffled:
    """A source long enough that the buffer stays full while ``batches`` batches and what the workers
    prefetch beyond them are read (``prefetch_factor=2`` per worker), with a margin."""
    spare = 4 * sizes["num_workers"]
    items = sizes["buffer_size"] + (batches + spare) * sizes["batch_size"]
    return Shuffled(list(range(items)), buffer_size=sizes["buffer_size"], seed=0)


# --------------------------------------------------------------------------- time per batch
@dataclass(frozen=True)
class CaptureResult:
    name: str
    us_per_batch: float  # wall in next(), median of the rounds, first batch left out
    best_us_per_batch: float
    main_cpu_us: float  # CPU of the main process per batch
    worker_cpu_us: float  # CPU of all workers per batch timed (start-up and buffer fill included)
    worker_faults: float  # minor page faults of all workers per batch timed, counted as worker_cpu_us is
    first_batch_ms: float
    ratio: float  # us_per_batch / the bare DataLoader's
    best_ratio: float
    messages_per_batch: float  # what the main process received per batch, data queue and channels
    extra_bytes: float  # pickled bytes per message from the data queue beyond the bare loader's (a batch)
    channel_messages: int  # messages on our own channels over the counted pass (instructions and replies)


def bench_capture(sizes: dict, accelerators: Optional[dict] = None,
                  names: Sequence[str] = CONTENDERS) -> list[CaptureResult]:
    """Time ``sizes["batches"]`` batches per contender per round, then count one pass's messages."""
    accelerators = accelerators or _accelerators()
    batches, workers = sizes["batches"], sizes["num_workers"]
    loaders = {name: _build(name, accelerators, stream(sizes, batches), sizes["batch_size"], workers)
               for name in names}
    for loader in loaders.values():  # warm-up: imports, first allocations
        _time_pass(loader, 8)
    samples: dict = {name: [] for name in names}
    for round_index in range(sizes["rounds"]):
        gc.collect()
        for name in rotated(names, round_index):
            samples[name].append(_time_and_count(loaders[name], batches))
    counted = {name: count_messages(loaders[name], min(batches, 64)) for name in names}
    bare_bytes = counted[BARE][1] / counted[BARE][0] if BARE in counted else 0.0
    medians = {name: [statistics.median(column) for column in zip(*samples[name])] for name in names}
    bests = {name: min(s[1] for s in samples[name]) for name in names}
    base, base_best = medians.get(BARE, medians[names[0]])[1], bests.get(BARE, bests[names[0]])
    return [
        CaptureResult(
            name=name, us_per_batch=medians[name][1] * 1e6, best_us_per_batch=bests[name] * 1e6,
            main_cpu_us=medians[name][2] * 1e6, worker_cpu_us=medians[name][3] * 1e6,
            worker_faults=medians[name][4],
            first_batch_ms=medians[name][0] * 1e3, ratio=medians[name][1] / base, best_ratio=bests[name] / base_best,
            messages_per_batch=counted[name][0], extra_bytes=counted[name][1] / counted[name][0] - bare_bytes,
            channel_messages=counted[name][2],
        )
        for name in names
    ]


def _time_and_count(loader: Any, batches: int) -> tuple[float, ...]:
    """``_time_pass``'s figures, and the workers' minor page faults per batch: counted, unlike CPU time, the same
    however loaded the machine is (a record that copies the shuffle buffer after every batch faulted in workers,
    not in one process)."""
    faults = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
    timed = _time_pass(loader, batches)
    return (*timed, (resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - faults) / batches)


# --------------------------------------------------------------------------- what crosses per batch
class _Tally:
    def __init__(self) -> None:
        self.messages, self.bytes = 0, 0
        self.lock = threading.Lock()
        # Shared memory inherited by forked workers: a worker's reply or ring is counted where it is sent.
        self.channel = multiprocessing.get_context("fork").Value("q", 0)


@contextlib.contextmanager
def _counting() -> Iterator[_Tally]:
    """Count what the main process takes from its workers: the base loaders' data queues (torch's and
    torchdata's iterators), sized pickled, and every message of our channels, both ways."""
    tally = _Tally()
    patched: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, attribute: str, make: Callable[[Any], Any]) -> None:
        original = getattr(owner, attribute)
        patched.append((owner, attribute, original))
        setattr(owner, attribute, make(original))

    def data_queue(original: Callable) -> Callable:
        def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            ok, data = original(self, *args, **kwargs)
            if ok:
                with tally.lock:
                    tally.messages += 1
                    tally.bytes += len(pickle.dumps(data[1], protocol=pickle.HIGHEST_PROTOCOL))
            return ok, data
        return counted

    def channel(original: Callable) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            with tally.channel.get_lock():
                tally.channel.value += 1
            return original(*args, **kwargs)
        return counted

    wrap(torch_dataloader._MultiProcessingDataLoaderIter, "_try_get_data", data_queue)
    wrap(torchdata_loader._StatefulMultiProcessingDataLoaderIter, "_try_get_data", data_queue)
    # Every instruction (main process), state reply and finished stream's ring (worker) is pickled once by
    # _channels._pickle; the workers fork inside this block and inherit the patch.
    wrap(_channels, "_pickle", channel)
    try:
        yield tally
    finally:
        for owner, attribute, original in reversed(patched):
            setattr(owner, attribute, original)


def count_messages(loader: Any, batches: int) -> tuple[float, float, int]:
    """(messages received per batch, pickled bytes received per batch, channel messages) over ``batches``
    batches of one pass, counted up to the last batch taken (what the workers prefetched beyond is left out
    only as far as the queue holds it)."""
    with _counting() as tally:
        iterator = iter(loader)
        for _ in range(batches):
            next(iterator)
        messages, size, channel = tally.messages, tally.bytes, tally.channel.value
        del iterator
        abandon(loader)
    return messages / batches, size / batches, channel


# --------------------------------------------------------------------------- where a worker's time goes
def capture_profile(sizes: dict, batches: int = 200) -> dict:
    """Microseconds per batch of what one worker does, timed in this process: reading its share of a batch
    (``batch_size`` kept items: ``num_workers`` times as many read through the buffer) and what our loader adds
    per batch, recording the dataset's ``state_dict()`` and the stream's RNG states (``_stream._snapshot``)."""
    dataset = stream(sizes, batches * sizes["num_workers"])
    position = DatasetPosition(dataset)
    info = WorkerInfo(id=0, num_workers=sizes["num_workers"], seed=0, dataset=dataset)
    read = state = rng = converted = 0.0
    with shown_worker_info(info), no_gc():
        items = iter(dataset)
        next(items)  # fills the buffer: what follows is the steady state
        for _ in range(batches):
            started = time.perf_counter()
            for _ in range(sizes["batch_size"]):
                next(items)
            recorded = time.perf_counter()
            position.record()
            ranked = time.perf_counter()
            _stream_rng.Taken()  # what a worker takes after each batch
            taken = time.perf_counter()
            _stream_rng.record()  # the same put in checkpoint types, as every batch did before: for comparison
            read, state, rng = read + recorded - started, state + ranked - recorded, rng + taken - ranked
            converted += time.perf_counter() - taken
    per = 1e6 / batches
    return {"read_us": read * per, "state_dict_us": state * per, "rng_us": rng * per,
            "rng_converted_us": converted * per,
            "state_bytes": len(pickle.dumps(dataset.state_dict(), protocol=pickle.HIGHEST_PROTOCOL))}


# --------------------------------------------------------------------------- report
def capture_table(results: Sequence[CaptureResult]) -> list[str]:
    header = ["loader", "µs / batch (median)", "vs bare", "vs bare (best)", "main CPU µs / batch",
              "worker CPU µs / batch", "worker page faults / batch", "first batch (ms)", "messages / batch",
              "bytes / message beyond bare", "channel messages / pass"]
    rows = [[r.name, f"{r.us_per_batch:,.0f}", f"{r.ratio:.2f}x", f"{r.best_ratio:.2f}x", f"{r.main_cpu_us:,.0f}",
             f"{r.worker_cpu_us:,.0f}", f"{r.worker_faults:,.1f}", f"{r.first_batch_ms:,.0f}",
             f"{r.messages_per_batch:.2f}", f"{r.extra_bytes:,.0f}", str(r.channel_messages)] for r in results]
    return table(header, rows)


def profile_table(profile: dict) -> list[str]:
    total = profile["read_us"] + profile["state_dict_us"] + profile["rng_us"]
    rows = [[what, f"{profile[key]:,.1f}", f"{profile[key] / profile['read_us']:.1%}"]
            for what, key in (("read the share of one batch", "read_us"), ("dataset state_dict()", "state_dict_us"),
                              ("stream RNG states, taken", "rng_us"),
                              ("(not done per batch) the same in checkpoint types", "rng_converted_us"))]
    rows.append(["capture (state_dict + RNG) / read", "", f"{(total - profile['read_us']) / profile['read_us']:.1%}"])
    return table(["one worker, per batch", "µs", "of reading"], rows)


def render(env: dict, sizes: dict, results: Sequence[CaptureResult], profile: dict) -> str:
    lines = ["## Machine", ""] + [f"- {key}: {value}" for key, value in env.items()] + [""]
    lines += [
        f"## Per-batch cost, Shuffled(buffer_size={sizes['buffer_size']:,}), num_workers={sizes['num_workers']}", "",
        f"The first {sizes['batches']} batches of a pass (batch_size={sizes['batch_size']}), {sizes['rounds']} "
        f"interleaved rounds; {os.cpu_count()} CPU cores for {sizes['num_workers']} workers and the main process. "
        "Messages and bytes: one untimed pass of up to 64 batches.", "", *capture_table(results), "",
        "## Where a worker's time goes, per batch (one process, no other worker running)", "",
        f"The state recorded is {profile['state_bytes']:,} bytes pickled.", "", *profile_table(profile), "",
    ]
    return "\n".join(lines) + "\n"


def measure(sizes: dict, started: float) -> tuple[Callable[[dict], str], dict]:
    print(f"[{time.perf_counter() - started:5.0f} s] per-batch cost with {sizes['num_workers']} workers …", flush=True)
    results = bench_capture(sizes)
    profile = capture_profile(sizes)
    return (lambda env: render(env, sizes, results, profile)), {"capture": results, "profile": profile}


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_main(argv, __doc__, "120 batches, 2 rounds", (QUICK_SIZES, FULL_SIZES), measure)


if __name__ == "__main__":
    sys.exit(main())
