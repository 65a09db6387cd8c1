"""Language-model sources: what a resume loses, what a batch costs, and how long a resume takes.

Everything in one process, beside the alternatives; no figure is asserted anywhere
(``tests/test_bench_lm_smoke.py`` runs these functions on tiny sizes so the script keeps working).
The sources are local JSON-lines files written into a temporary folder (three sources, weights
0.6 / 0.3 / 0.1, eight shards each); nothing is downloaded. ``benchmarks/_lm_data.py`` holds the pipelines.

A. **Rows lost and repeated on resume.** 🤗 ``interleave_datasets(probabilities=...)`` of the three streams,
   ``.shuffle(buffer_size=B)``, resumed through its own ``state_dict()``/``load_state_dict()``, against
   ours: ``Shuffled(Mixture(streams), B)`` and ``Mixture({name: exact_shuffle(stream.shuffle(buffer_size=B))})``.
   One uninterrupted pass records each pipeline's order and its state at several save points; each resume
   then reads to the end. Lost: rows of the uninterrupted rest the resumed run never delivers; repeated: rows
   delivered twice over the run. Ours also report the rows a resume reads again (reading, not delivering).
B. **Per-batch cost of ``Packed(Mixture(...))``** against a bare generator doing the same (weighted draws with
   ``random.Random``, concatenate-and-cut packing, the same rows), through a plain torch ``DataLoader``
   (batch_size 8, seq_len 2048, 0 and 2 workers) and read directly (8 rows a batch, no collate).
   Interleaved rounds (the order rotates each round), median; the pass's first batch is left out.
C. **Time from ``load_state_dict`` to the first row** at 10 %, 50 % and 90 % of a long stream, every
   (pipeline, position) pair once per round in a shuffled order, median of the rounds. Building the
   pipeline is not timed.

Usage::

    python benchmarks/bench_lm.py --quick                      # about 30 s
    python benchmarks/bench_lm.py --markdown lm.md --json bench_out/lm.json
"""

from __future__ import annotations

import gc
import itertools
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Optional, Sequence

from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when a test loads this file
import _lm_data as lm  # noqa: E402
from _common import no_gc, rotated, run_main, table  # noqa: E402

FULL_SIZES = {
    "lost": {"buffers": [1_000, 10_000], "documents_per_buffer": 20, "fractions": [0.25, 0.5, 0.75]},
    "per_batch": {"batch_size": 8, "seq_len": 2048, "batches": 150, "rounds": 5, "workers": [0, 2]},
    "resume": {"documents": 200_000, "buffer": 1_000, "fractions": [0.1, 0.5, 0.9], "rounds": 3},
}
QUICK_SIZES = {
    "lost": {"buffers": [1_000], "documents_per_buffer": 10, "fractions": [0.5]},
    "per_batch": {"batch_size": 8, "seq_len": 2048, "batches": 40, "rounds": 2, "workers": [0, 2]},
    "resume": {"documents": 20_000, "buffer": 1_000, "fractions": [0.1, 0.5, 0.9], "rounds": 1},
}
BARE = "bare generator"
OURS = "Packed(Mixture)"


def _progress(started: float, what: str) -> None:
    print(f"[{time.perf_counter() - started:5.0f} s] {what} …", flush=True)


# --------------------------------------------------------------------------- A: rows lost and repeated
def one_pass(name: str, files: dict, buffer_size: int, positions: Sequence[int]) -> tuple[list, dict, float]:
    """The uninterrupted order of pipeline ``name``, its state after each of ``positions`` rows, the seconds."""
    pipe, ids, states, wanted = lm.pipeline(name, files, buffer_size), [], {}, set(positions)
    start = time.perf_counter()
    for row in pipe:
        ids.append(row["id"])
        if len(ids) in wanted:
            states[len(ids)] = pipe.state_dict()
    return ids, states, time.perf_counter() - start


def bench_lost(files: dict, buffer_size: int, positions: Sequence[int]) -> list[dict]:
    """One row per (pipeline, save point): lost, repeated, exact, rows read again, rows in the pass."""
    out = []
    for name in lm.RESUME_PIPELINES:
        ids, states, _ = one_pass(name, files, buffer_size, positions)
        for at in positions:
            if at not in states:
                continue  # the stream ended before
            pipe = lm.pipeline(name, files, buffer_size)
            pipe.load_state_dict(states[at])
            rest = [row["id"] for row in pipe]
            before, after = ids[:at], ids[at:]
            run = before + rest
            out.append({"pipeline": name, "buffer": buffer_size, "at": at, "rows": len(ids),
                        "lost": len(set(after) - set(rest)), "repeated": len(run) - len(set(run)),
                        "exact": rest == after, "read_again": lm.read_again(name, states[at])})
    return out


# --------------------------------------------------------------------------- B: per-batch cost
def _time_batches(iterator: Any, batches: int) -> float:
    """Seconds per batch for batches 2 to ``batches + 1`` of ``iterator`` (the first: start-up)."""
    next(iterator)
    with no_gc():
        start = time.perf_counter()
        for _ in range(batches):
            next(iterator)
        return (time.perf_counter() - start) / batches


def _direct(dataset: Any, batch_size: int) -> Any:
    """Rows read directly, ``batch_size`` at a time (a list of rows: no collate); a last partial batch is left out."""
    rows = iter(dataset)
    while len(batch := list(itertools.islice(rows, batch_size))) == batch_size:
        yield batch


def bench_per_batch(sources: dict, batch_size: int, seq_len: int, batches: int, rounds: int,
                    workers: Sequence[int]) -> list[dict]:
    """µs per batch of ours and of the bare generator, per way of reading (direct, DataLoader with w workers)."""
    datasets = {BARE: lm.BarePacked(sources, seq_len), OURS: lm.ours_packed(sources, seq_len)}
    ways: dict[str, Callable[[Any], Any]] = {"read directly": lambda ds: _direct(ds, batch_size)}
    for w in workers:
        ways[f"DataLoader, num_workers={w}"] = (
            lambda ds, w=w: iter(DataLoader(ds, batch_size=batch_size, num_workers=w)))
    out = []
    for way, make in ways.items():
        times: dict = {name: [] for name in datasets}
        for round_index in range(rounds):
            gc.collect()
            for name in rotated(list(datasets), round_index):
                iterator = make(datasets[name])
                times[name].append(_time_batches(iterator, batches))
                del iterator
        bare = statistics.median(times[BARE])
        for name in datasets:
            median = statistics.median(times[name])
            out.append({"way": way, "source": name, "us_per_batch": median * 1e6, "best_us": min(times[name]) * 1e6,
                        "ratio": median / bare, "best_ratio": min(times[name]) / min(times[BARE])})
    return out


# --------------------------------------------------------------------------- C: resume time
def bench_resume(files: dict, buffer_size: int, positions: Sequence[int], rounds: int) -> list[dict]:
    """Median seconds from ``load_state_dict`` to the first row, per pipeline and position."""
    states, firsts, positioning = {}, {}, {}
    for name in lm.RESUME_PIPELINES:
        ids, found, positioning[name] = one_pass(name, files, buffer_size, positions)
        for at in positions:
            states[name, at], firsts[name, at] = found[at], ids[at]
    times: dict = {pair: [] for pair in states}
    exact = dict.fromkeys(states, True)
    order = list(states)
    for _ in range(rounds):
        random.Random(len(times[order[0]])).shuffle(order)
        for name, at in order:
            pipe = lm.pipeline(name, files, buffer_size)
            gc.collect()
            with no_gc():
                start = time.perf_counter()
                pipe.load_state_dict(states[name, at])
                first = next(iter(pipe))
                times[name, at].append(time.perf_counter() - start)
            exact[name, at] &= first["id"] == firsts[name, at]
            del pipe, first
    return [{"pipeline": name, "seconds": {at: statistics.median(times[name, at]) for at in positions},
             "best": {at: min(times[name, at]) for at in positions}, "positioning_s": positioning[name],
             "exact": all(exact[name, at] for at in positions), "rounds": rounds,
             "read_again": {at: lm.read_again(name, states[name, at]) for at in positions}}
            for name in lm.RESUME_PIPELINES]


# --------------------------------------------------------------------------- report
def lost_table(rows: Sequence[dict]) -> list[str]:
    header = ["pipeline", "buffer", "saved after row", "rows in the pass", "rows lost", "rows repeated",
              "rest = uninterrupted", "rows read again"]
    return table(header, [[r["pipeline"], f"{r['buffer']:,}", f"{r['at']:,}", f"{r['rows']:,}", f"{r['lost']:,}",
                           f"{r['repeated']:,}", "yes" if r["exact"] else "no",
                           "-" if r["read_again"] is None else f"{r['read_again']:,}"] for r in rows])


def per_batch_table(rows: Sequence[dict]) -> list[str]:
    header = ["read through", "source", "µs / batch (median)", "ours / bare", "µs / batch (best)",
              "ours / bare (best)"]
    return table(header, [[r["way"], r["source"], f"{r['us_per_batch']:,.0f}", f"{r['ratio']:.2f}x",
                           f"{r['best_us']:,.0f}", f"{r['best_ratio']:.2f}x"] for r in rows])


def resume_table(rows: Sequence[dict], documents: int) -> list[str]:
    positions = sorted(rows[0]["seconds"])
    header = (["pipeline"] + [f"{at / documents:.0%} (s)" for at in positions]
              + [f"{positions[-1] / documents:.0%} / {positions[0] / documents:.0%}", "best at 90 % (s)",
                 "rows read again", "first row exact", "positioning (s)"])
    return table(header, [
        [r["pipeline"], *[f"{r['seconds'][at]:.3f}" for at in positions],
         f"{r['seconds'][positions[-1]] / r['seconds'][positions[0]]:.2f}x", f"{r['best'][positions[-1]]:.3f}",
         " / ".join("-" if r["read_again"][at] is None else f"{r['read_again'][at]:,}" for at in positions),
         "yes" if r["exact"] else "no", f"{r['positioning_s']:.1f}"] for r in rows])


def render(env: dict, sizes: dict, lost: list, per_batch: list, resume: list) -> str:
    spec, resumed = sizes["per_batch"], sizes["resume"]
    lines = ["## Machine", ""] + [f"- {key}: {value}" for key, value in env.items()] + [""]
    lines += ["## A. Rows lost and repeated by a resume", "",
              f"{sizes['lost']['documents_per_buffer']} × buffer_size documents over three sources; one resume per "
              "save point, read to the end of the stream.", "", *lost_table(lost), ""]
    lines += ["## B. Per-batch cost of Packed(Mixture(...)) against a bare generator", "",
              f"batch_size={spec['batch_size']}, seq_len={spec['seq_len']}, {spec['batches']} batches timed per "
              f"round, {spec['rounds']} interleaved rounds; documents of 16 to 1,200 tokens in lists.", "",
              *per_batch_table(per_batch), ""]
    lines += ["## C. Time from load_state_dict to the first row", "",
              f"{resumed['documents']:,} documents, buffer_size={resumed['buffer']:,}, {resumed['rounds']} rounds "
              "(median); positioning: seconds of the uninterrupted pass that took the states (not timed).", "",
              *resume_table(resume, resumed["documents"]), ""]
    return "\n".join(lines) + "\n"


def run_all(sizes: dict, started: float, folder: str) -> tuple[list, list, list]:
    lost = []
    spec = sizes["lost"]
    for buffer_size in spec["buffers"]:
        documents = spec["documents_per_buffer"] * buffer_size
        _progress(started, f"A. rows lost and repeated, buffer {buffer_size:,}")
        files = lm.write_sources(os.path.join(folder, f"lost-{buffer_size}"), documents)
        lost += bench_lost(files, buffer_size, [int(documents * f) for f in spec["fractions"]])
    spec = sizes["per_batch"]
    _progress(started, "B. per-batch cost")
    documents = spec["batches"] * 60 * max(spec["workers"] + [1])  # about 27 documents a batch, spare for the pass
    per_batch = bench_per_batch(lm.token_documents(documents), spec["batch_size"], spec["seq_len"], spec["batches"],
                                spec["rounds"], spec["workers"])
    spec = sizes["resume"]
    _progress(started, f"C. resume time, {spec['documents']:,} documents")
    files = lm.write_sources(os.path.join(folder, "resume"), spec["documents"])
    resume = bench_resume(files, spec["buffer"], [int(spec["documents"] * f) for f in spec["fractions"]],
                          spec["rounds"])
    return lost, per_batch, resume


def measure(sizes: dict, started: float) -> tuple[Callable[[dict], str], dict]:
    with tempfile.TemporaryDirectory(prefix="bench_lm_") as folder:
        lost, per_batch, resume = run_all(sizes, started, folder)
    import datasets

    data = {"lost": lost, "per_batch": per_batch, "resume": resume, "datasets": datasets.__version__}
    return (lambda env: render({**env, "datasets": datasets.__version__}, sizes, lost, per_batch, resume)), data


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_main(argv, __doc__, "about 30 s", (QUICK_SIZES, FULL_SIZES), measure)


if __name__ == "__main__":
    sys.exit(main())
