"""A language-model pipeline killed and resumed on 2, 3 and 1 processes, with a weight change (issue 20).

``lm_pipeline_train.py`` trains on ``Packed(Mixture(table, web, code))``: a map-style source, a
``datasets`` stream from local json shards behind a shuffle buffer (``exact_shuffle``), and a stateful
iterable. The run is killed (SIGKILL to every process) at steps drawn at random and started again each
time: on 2 processes with 2 workers, again on the same, then on 3 processes without workers, leaving out four
rows ahead (``skip_samples``, as after a loss spike), then on 1 process with 1 worker and new mixture weights.
Required:

- across the first kill (same topology, same weights), the rows every rank took, in global order, are the
  uninterrupted run's: the dispatcher deals the base loader's batches (its workers taking turns) to the
  ranks in turn, which a plain ``DataLoader`` over the pipeline reproduces;
- over the whole run, for every source, the documents delivered are that source's first ones in its own
  order, each token once: none lost or repeated (steps after the last save are trained again after a kill:
  only the ones the resumed run did not redo count). Worker shares are read in turns, so across sources
  and within one the rows come in the shares' interleaving, not the pipeline's plain order;
- the rows left out never come, in that launch or the next, and the next launch's resume line names them;
- the weight change is logged once, saying from which sample; the last launch reaches the end of the data.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import datasets
import pytest

import mp_harness

sys.path.insert(0, str(Path(__file__).parent))
import lm_pipeline_train as lm  # noqa: E402

SCRIPT = Path(lm.__file__)
NEW_WEIGHTS = {"table": 0.2, "web": 0.3, "code": 0.5}
SEED = 20  # the kill plan's


def plan(seed: int) -> list[tuple[int, int, int, dict]]:
    """(world, workers, kill after this step or -1, weights) per launch; kills at random steps."""
    rng = random.Random(seed)
    kills = [rng.randint(4, 8)]
    for _ in range(2):
        kills.append(kills[-1] + rng.randint(3, 6))
    return [(2, 2, kills[0], lm.WEIGHTS), (2, 2, kills[1], lm.WEIGHTS), (3, 0, kills[2], lm.WEIGHTS),
            (1, 1, -1, NEW_WEIGHTS)]


def run_launch(out: Path, index: int, world: int, workers: int, kill_at: int, weights: dict, skip=None):
    args = [out, index, workers, kill_at, json.dumps(weights)] + ([json.dumps(list(skip))] if skip else [])
    command = mp_harness.accelerate_command(SCRIPT, args, world)
    env = {"HF_HOME": str(out / "hf_home"), "PYTHONPATH": str(Path(__file__).parent)}
    folder = out / f"launch{index}"
    if kill_at < 0:
        done = mp_harness.launch(command, folder, timeout_s=240, collective_timeout_s=60, watch=[out], **env)
        assert done.ok, f"launch {index}:\n{done.report()}"
        return done
    job = mp_harness.start(command, folder, 60, **env)
    deadline = time.monotonic() + 240
    try:
        while not (out / f"kill{index}").exists():
            assert not job.ended(), f"launch {index} ended before its kill:\n{mp_harness.finish(job, 0).report()}"
            assert time.monotonic() < deadline, f"launch {index} never reached step {kill_at}"
            time.sleep(0.2)
    finally:
        job.kill()  # SIGKILL to the launcher, every rank and every worker
    return mp_harness.finish(job, 0)


def read_launch(out: Path, index: int, world: int) -> list[list[dict]]:
    return [[json.loads(line) for line in (out / f"launch{index}_rank{rank}.jsonl").read_text().splitlines()]
            for rank in range(world)]


def kept_rows(launches: list[list[list[dict]]]) -> tuple[list[list[list[int]]], list[int]]:
    """Per launch, the rows in global order (step, then rank) that the run kept; where each launch started."""
    starts = [entries[0][0]["step"] for entries in launches]
    kept: list = []
    for index, ranks in enumerate(launches):
        until = starts[index + 1] if index + 1 < len(launches) else float("inf")
        kept.append([row for step in steps_of(ranks, until=until) for rank_rows in step for row in rank_rows])
    return kept, starts


def steps_of(ranks: list[list[dict]], after: float = float("-inf"), until: float = float("inf")) -> list:
    """The rows of each step in (``after``, ``until``], in step order: per step, every rank's rows in rank order."""
    by_step: dict = {}
    for entries in ranks:
        for entry in entries:
            if "rows" in entry and after < entry["step"] <= until:
                by_step.setdefault(entry["step"], []).append(entry["rows"])
    return [by_step[step] for step in sorted(by_step)]


def uninterrupted(data: Path, world: int, dataset=None) -> list[list[int]]:
    """The rows a run on ``world`` processes takes, in global order, without kills (``dataset``: the pipeline,
    ``lm.pipeline`` by default), on any number of workers: the package's loader deals the sequence to its workers
    in blocks of one batch, so its batches are those of a plain ``DataLoader`` without workers."""
    from torch.utils.data import DataLoader

    dataset = lm.pipeline(data, lm.WEIGHTS) if dataset is None else dataset
    loader = DataLoader(dataset, batch_size=lm.BATCH, drop_last=True)
    batches = [batch["input_ids"].tolist() for batch in loader]
    steps = len(batches) // world  # the dispatcher deals batch i to rank i % world; a last partial step is dropped
    return [row for batch in batches[: steps * world] for row in batch]


def source_orders(data: Path) -> dict[str, list[int]]:
    """Each source's tokens in its own order, read directly."""
    web = [token for doc in lm.web_stream(data) for token in doc["input_ids"]]
    return {"table": [t for d in range(lm.DOCS) for t in lm.document("table", d)["input_ids"]], "web": web,
            "code": [t for d in range(lm.DOCS) for t in lm.document("code", d)["input_ids"]]}


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_a_mixture_packed_killed_and_resumed_on_2_3_1_processes_loses_and_repeats_nothing(tmp_path):
    out = tmp_path / "out"
    lm.write_web_shards(out / "data")
    chain = plan(SEED)
    done = [run_launch(out, index, *launch) for index, launch in enumerate(chain[:2])]
    # Rows ahead of every worker share at the checkpoint launch 2 resumes from (the last save before launch 1's
    # kill; two shares, each at most one batch of 4 rows ahead of the rows taken), behind launch 3's weight change.
    taken = chain[1][2] // lm.SAVE_EVERY * lm.SAVE_EVERY * 2 * lm.BATCH
    skip = (taken + 8, taken + 12)
    done += [run_launch(out, 2, *chain[2], skip=skip), run_launch(out, 3, *chain[3])]
    launches = [read_launch(out, index, world) for index, (world, *_) in enumerate(chain)]
    kept, starts = kept_rows(launches)
    assert starts[0] == 0 and all(starts[i] < starts[i + 1] <= chain[i][2] for i in range(3)), starts
    assert any("done" in entry for entry in launches[-1][0]), "the last launch did not reach the end of the data"

    # Across a kill on the same topology, the run is the uninterrupted one, row for row.
    same = kept[0] + kept[1]
    assert same == uninterrupted(out / "data", 2)[: len(same)]

    # Over the whole run, each source delivered its first documents in its own order, each token once, but
    # the tokens of the rows left out.
    rows = [row for launch in kept for row in launch]
    reference = [row["input_ids"].tolist() for row in lm.pipeline(out / "data", lm.WEIGHTS)]
    left_out = {t for row in reference[skip[0]:skip[1]] for t in row}
    assert not left_out & {t for row in rows for t in row}, "a row left out came"
    # Given after launch 2's resume, the range is in its checkpoints: launch 3's resume line names it.
    assert f"leaving out samples [{skip[0]}, {skip[1]}) of epoch 0" in done[3].output, done[3].output[-3000:]
    orders = source_orders(out / "data")
    for name in lm.SOURCES:
        order = [t for t in orders[name] if t not in left_out]
        got = sorted((order.index(t), t) for row in rows for t in row if lm.decode(t)[0] == name)
        assert [t for _, t in got] == order[: len(got)], f"{name}: lost or repeated tokens"
    assert sorted(map(tuple, rows)) != sorted(map(tuple, reference))[: len(rows)], "the new weights changed nothing"
    change = int(done[3].output.split("weights change from global sample ")[1].split()[0].strip(",:"))
    assert change >= skip[1], f"the weights changed at sample {change}, inside the rows left out {skip}"
    said = [launch.output.count("weights change from global sample") for launch in done]
    assert said == [0, 0, 0, 1], f"{said}\n{done[-1].output[-3000:]}"
