"""Elastic resume with real processes: one run continued on 2, 3, 2, 1 and 2 processes, workers 0 <-> 2.

Every launch trains a DDP model with gradient accumulation over 2 steps and the first save falls inside an
accumulation window: after each elastic resume all ranks agree on ``accelerator.step`` (else they deadlock in
backward), and a rank that did not exist when the checkpoint was written has the random state derived from the
saved main process's and its rank.

Each launch runs every source of ``mp_elastic.SOURCES`` (map-style data, a user's batch_sampler, a stateful
stream every rank reads whole, torch's worker_init_fn recipe under the dispatcher over an opaque stream, and
a user sampler that shuffles with NumPy's global RNG). Each
launch's batches, on every rank, must equal an in-process simulation of the same chain (whose properties
`test_elastic.py`, `test_batch_sampler.py` and `test_replicated_elastic.py` check exhaustively), and every
epoch must deliver every sample.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from accelerate_stateful import (
    BatchSamplerDataLoader, DispatchDataLoader, DistContext, IterableShardDataLoader, SampleRNG, ShardDataLoader,
)

from accelerate_stateful.training._agreement import new_rank_seed
from accelerate_stateful.training._rng import sample_seed

from cli_run import cli_json
from harness import through_files

sys.path.insert(0, str(Path(__file__).parent))
import mp_elastic  # noqa: E402
import mp_harness  # noqa: E402

# (world size, workers, stop epoch, stop batch): 2->3, 3->2, 2->1, 1->2, workers alternating 0 and 2; the
# first stop leaves an odd accelerator.step, inside a window of 2 accumulation steps.
CHAIN = [(2, 0, 0, 5), (3, 2, 1, 3), (2, 0, 1, 3), (1, 2, 2, 10), (2, 0, -1, -1)]


def launch(out: Path, index: int, world: int, workers: int, stop_epoch: int, stop_batch: int) -> None:
    script = [out, index, workers, stop_epoch, stop_batch]
    done = mp_harness.launch(mp_harness.accelerate_command(Path(mp_elastic.__file__), script, world),
                             out / f"launch{index}", timeout_s=240, collective_timeout_s=60, watch=[out],
                             HF_HOME=str(out / "hf_home"))  # the repository is on its PYTHONPATH already
    assert done.ok, f"launch {index} (world {world}):\n{done.report()}"


LOADERS = {"map": ShardDataLoader, "batch-sampler": BatchSamplerDataLoader, "stream": IterableShardDataLoader,
           "recipe": DispatchDataLoader, "numpy-sampler": ShardDataLoader}


def simulate(source: str) -> list[dict[int, list]]:
    """The same chain on ranks simulated in one process: per launch, per rank, the (epoch, ids) of each batch."""
    state, launches = None, []
    for world, workers, stop_epoch, stop_batch in CHAIN:
        per_rank, saved = {}, None
        for rank in range(world):
            data = mp_elastic.make_loader(2 if source == "recipe" else 0, source)
            seed = {"data_seed": mp_elastic.DATA_SEEDS[source]} if source in mp_elastic.DATA_SEEDS else {}
            loader = LOADERS[source].from_dataloader(data, DistContext(rank, world), **seed)
            if state is not None:
                loader.load_state_dict(state)
            seen = []
            for epoch in range(loader.epoch, mp_elastic.EPOCHS):
                stop, taken = False, 0
                for batch in loader:
                    seen.append((epoch, mp_elastic.ids_and_draws(batch)[0]))
                    taken += 1
                    if (epoch, taken) == (stop_epoch, stop_batch):
                        stop = True
                        if rank == 0:  # saved inside the loop, as the launch does (the return then drops the pass)
                            saved = through_files(loader.state_dict())
                        break
                if stop:
                    break
            if stop_epoch >= 0:
                assert seen and seen[-1][0] == stop_epoch, f"launch {len(launches)} never reaches its stop"
            per_rank[rank] = seen
        launches.append(per_rank)
        state = saved
    return launches


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_run_continued_on_2_3_2_1_2_processes_delivers_exactly_the_simulated_batches(tmp_path):
    for index, (world, workers, stop_epoch, stop_batch) in enumerate(CHAIN):
        launch(tmp_path, index, world, workers, stop_epoch, stop_batch)
        if index:
            for source in mp_elastic.SOURCES:
                check_agreement(tmp_path, source, index, world, CHAIN[index - 1][0])
    for source in mp_elastic.SOURCES:
        expected = simulate(source)
        delivered_per_epoch: dict[int, list[int]] = {}
        for index, (world, *_rest) in enumerate(CHAIN):
            for rank in range(world):
                lines = (tmp_path / f"launch{index}.{source}.rank{rank}.jsonl").read_text().splitlines()
                rows = list(map(json.loads, lines))
                got = [(row["epoch"], row["ids"]) for row in rows]
                for row in rows:  # the augmentation is the same pure function of (seed, epoch, sample) everywhere
                    expected_draws = [mp_elastic.augmentation(SampleRNG(sample_seed(mp_elastic.SEED, row["epoch"], i)))
                                      for i in row["ids"]] if source == "map" else []
                    assert row["draws"] == expected_draws, f"{source}: launch {index}, rank {rank}: augmentation"
                assert got == expected[index][rank], f"{source}: launch {index} (world {world}), rank {rank} differs"
                for epoch, ids in got:
                    delivered_per_epoch.setdefault(epoch, []).extend(ids)
        for epoch, ids in delivered_per_epoch.items():
            assert set(ids) == set(range(mp_elastic.SAMPLES)), f"{source}: epoch {epoch} lost samples"
            assert len(ids) - mp_elastic.SAMPLES < 3 * 3 * 2, f"{source}: epoch {epoch} repeated more than the padding"
    # `accelerate-stateful samples --world-size` predicts, from the last two checkpoints alone (2 -> 1 and
    # 1 -> 2 processes), what each rank of the next launch read of the map-style source in the rest of the epoch.
    for number, resumed in ((2, 3), (3, 4)):
        world, stop_epoch = CHAIN[resumed][0], CHAIN[resumed - 1][2]
        predicted = cli_json("samples", tmp_path / "map" / "checkpoints" / f"checkpoint_{number}", "--remaining",
                             "--world-size", world)
        for rank in range(world):
            lines = (tmp_path / f"launch{resumed}.map.rank{rank}.jsonl").read_text().splitlines()
            read = [row["ids"] for row in map(json.loads, lines) if row["epoch"] == stop_epoch]
            assert read and [b["indices"] for b in predicted["ranks"][rank]["batches"]] == read, (resumed, rank)


def check_agreement(out: Path, source: str, index: int, world: int, saved_world: int) -> None:
    """After a resume: every rank has the saved accelerator.step (inside a window); new ranks' RNGs derived."""
    meta = [json.loads((out / f"launch{index}.{source}.rank{r}.meta.json").read_text()) for r in range(world)]
    steps = [m["step"] for m in meta]
    assert len(set(steps)) == 1, f"{source}, launch {index}: the ranks disagree on accelerator.step: {steps}"
    if index == 1:  # saved on 2 processes inside an accumulation window, resumed on 3
        assert steps[0] % mp_elastic.ACCUMULATION == 1, f"{source}: launch 1 resumed at step {steps[0]}, not mid-window"
    saved_main = torch.tensor(meta[0]["rng_state"], dtype=torch.uint8)
    for rank in range(saved_world, world):
        torch.manual_seed(new_rank_seed(saved_main, rank))
        assert meta[rank]["rand"] == torch.rand(1).item(), f"{source}, launch {index}: rank {rank}'s random state"
    draws = [m["rand"] for m in meta]
    assert len(set(draws)) == world, f"{source}, launch {index}: ranks share a random state: {draws}"
