"""Elastic resume with real processes: one run continued on 2, 3, 2, 1 and 2 processes, workers 0 <-> 2.

Each launch's batches, on every rank, must equal an in-process simulation of the same chain (whose
properties `test_elastic.py` checks exhaustively), and every epoch must deliver every sample. Each sample
carries the augmentation its dataset drew from ``sample_rng``, which must be the same pure function of
(seed, epoch, sample) in every launch, whatever its world size, workers or resume point.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from accelerate_stateful import DistContext, SampleRNG, ShardDataLoader
from accelerate_stateful._rng import sample_seed

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


def simulate() -> list[dict[int, list]]:
    """The same chain on ranks simulated in one process: per launch, per rank, the (epoch, ids) of each batch."""
    state, launches = None, []
    for world, workers, stop_epoch, stop_batch in CHAIN:
        per_rank, saved = {}, None
        for rank in range(world):
            loader = ShardDataLoader.from_dataloader(mp_elastic.make_loader(0), DistContext(rank, world))
            if state is not None:
                loader.load_state_dict(state)
            seen = []
            for epoch in range(loader.epoch, mp_elastic.EPOCHS):
                stop = False
                for batch in loader:
                    seen.append((epoch, batch.tolist()))
                    if (epoch, loader.batches_yielded) == (stop_epoch, stop_batch):
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
    expected = simulate()
    delivered_per_epoch: dict[int, list[int]] = {}
    for index, (world, *_rest) in enumerate(CHAIN):
        for rank in range(world):
            lines = (tmp_path / f"launch{index}.rank{rank}.jsonl").read_text().splitlines()
            got = [(row["epoch"], row["ids"]) for row in map(json.loads, lines)]
            assert got == expected[index][rank], f"launch {index} (world {world}), rank {rank} differs"
            for epoch, samples in got:
                for sample_id, drawn in samples:
                    assert drawn == mp_elastic.augmentation(SampleRNG(sample_seed(mp_elastic.SEED, epoch, sample_id)))
                delivered_per_epoch.setdefault(epoch, []).extend(sample_id for sample_id, _ in samples)
    for epoch, ids in delivered_per_epoch.items():
        assert set(ids) == set(range(mp_elastic.SAMPLES)), f"epoch {epoch} lost samples"
        assert len(ids) - mp_elastic.SAMPLES < 3 * 3 * 2, f"epoch {epoch} repeated more than the padding"
