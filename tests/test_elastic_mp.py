"""Elastic resume with real processes: one run continued on 2, 3, 2, 1 and 2 processes, workers 0 <-> 2.

Each launch runs every source of ``mp_elastic.SOURCES`` (map-style data, a user's batch_sampler, a stateful
stream every rank reads whole, and torch's worker_init_fn recipe under the dispatcher over an opaque stream). Each
launch's batches, on every rank, must equal an in-process simulation of the same chain (whose properties
`test_elastic.py`, `test_batch_sampler.py` and `test_replicated_elastic.py` check exhaustively), and every
epoch must deliver every sample.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from accelerate_stateful import (
    BatchSamplerDataLoader, DispatchDataLoader, DistContext, IterableShardDataLoader, ShardDataLoader,
)

from cli_run import cli_json
from harness import through_files

sys.path.insert(0, str(Path(__file__).parent))
import mp_elastic  # noqa: E402

# (world size, workers, stop epoch, stop batch): 2->3, 3->2, 2->1, 1->2, workers alternating 0 and 2.
CHAIN = [(2, 0, 0, 4), (3, 2, 1, 3), (2, 0, 1, 3), (1, 2, 2, 10), (2, 0, -1, -1)]


def launch(out: Path, index: int, world: int, workers: int, stop_epoch: int, stop_batch: int) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "RANK", "WORLD_SIZE",
                                                                     "LOCAL_", "MASTER_"))}
    env.update(ACCELERATE_USE_CPU="1", HF_HOME=str(out / "hf_home"), PYTHONPATH=str(Path(__file__).parent.parent))
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision",
                "no", "--dynamo_backend", "no", "--num_processes", str(world), "--main_process_port",
                str(29610 + index)]
    if world > 1:
        launcher.insert(3, "--multi_gpu")
    script = [str(Path(mp_elastic.__file__)), str(out), str(index), str(workers), str(stop_epoch), str(stop_batch)]
    done = subprocess.run(launcher + script, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"launch {index} (world {world}) failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


LOADERS = {"map": ShardDataLoader, "batch-sampler": BatchSamplerDataLoader, "stream": IterableShardDataLoader,
           "recipe": DispatchDataLoader}


def simulate(source: str) -> list[dict[int, list]]:
    """The same chain on ranks simulated in one process: per launch, per rank, the (epoch, ids) of each batch."""
    state, launches = None, []
    for world, workers, stop_epoch, stop_batch in CHAIN:
        per_rank, saved = {}, None
        for rank in range(world):
            data = mp_elastic.make_loader(2 if source == "recipe" else 0, source)
            loader = LOADERS[source].from_dataloader(data, DistContext(rank, world))
            if state is not None:
                loader.load_state_dict(state)
            seen = []
            for epoch in range(loader.epoch, mp_elastic.EPOCHS):
                stop, taken = False, 0
                for batch in loader:
                    seen.append((epoch, batch.tolist()))
                    taken += 1
                    if (epoch, taken) == (stop_epoch, stop_batch):
                        stop = True
                        break
                if stop:
                    break
            if stop_epoch >= 0:
                assert seen and seen[-1][0] == stop_epoch, f"launch {len(launches)} never reaches its stop"
            per_rank[rank] = seen
            if rank == 0:
                saved = through_files(loader.state_dict())
        launches.append(per_rank)
        state = saved
    return launches


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_run_continued_on_2_3_2_1_2_processes_delivers_exactly_the_simulated_batches(tmp_path):
    for index, (world, workers, stop_epoch, stop_batch) in enumerate(CHAIN):
        launch(tmp_path, index, world, workers, stop_epoch, stop_batch)
    for source in mp_elastic.SOURCES:
        expected = simulate(source)
        delivered_per_epoch: dict[int, list[int]] = {}
        for index, (world, *_rest) in enumerate(CHAIN):
            for rank in range(world):
                lines = (tmp_path / f"launch{index}.{source}.rank{rank}.jsonl").read_text().splitlines()
                got = [(row["epoch"], row["ids"]) for row in map(json.loads, lines)]
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
