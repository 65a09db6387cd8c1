"""Rank side of the elastic grid (issue 28 §4): the links of several chains that run on one cell, in one launch.

The pipeline is the issue's: ``Packed(Mixture({table, web, code}))`` where ``table`` is a map-style list of
documents, ``web`` is a 🤗 ``datasets`` stream from local json shards shuffled with a buffer (``exact_shuffle``)
then filtered (``Filtered``, the package's filter stage), and ``code`` is a mosaicml-streaming
``StreamingDataset`` over local MDS shards. The documents are ``lm_pipeline_train``'s: every token names its
source, document and offset.

Usage (``grid.py`` writes the data and the launch's plan, then launches this)::

    accelerate launch ... tests/mp_grid.py DATA PLAN_JSON

``PLAN_JSON`` holds ``workers`` and ``links``: for each, the chain's folder, the launch's index in the chain,
the step to stop at (``-1``: the end of the data) and ``tail``. A link resumes the chain's newest checkpoint,
trains to its stop step, saves, trains ``tail`` more steps (what the next link, on the same cell, must repeat
row for row) and stops. Each rank appends what it did to ``<chain>/launch<INDEX>_rank<R>.jsonl``, as
``lm_pipeline_train`` does: the step it resumed at, each step's rows, the save, and ``done`` at the end of
the data.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch.distributed as dist
from accelerate.state import GradientState
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
from torch.utils.data import DataLoader

import lm_pipeline_train as lm
import mp_harness_rank
from accelerate_stateful import Accelerator
from accelerate_stateful.sources import Filtered, Mixture, Packed


def keep(document: dict) -> bool:
    """The filter stage: every fourth web document is dropped."""
    return lm.decode(int(document["input_ids"][0]))[1] % 4 != 3


def light_streaming() -> None:
    """Make ``import streaming.base.dataset`` import that module alone, not the package's front door.

    ``streaming/__init__.py`` imports its vision, text and multimodal datasets and its own data loader, which
    import torchvision, torch._dynamo and transformers: 5.7 CPU-seconds in every rank, most of a grid launch's
    time on 2 cores. The rank reads only ``StreamingDataset``, the same class either way. Called in a rank
    before anything imports ``streaming``; the launch side imports the package whole.
    """
    if "streaming" in sys.modules:
        return
    where = importlib.util.find_spec("streaming").submodule_search_locations[0]
    for name, path in (("streaming", where), ("streaming.base", f"{where}/base")):
        package = types.ModuleType(name)
        package.__path__ = [path]
        sys.modules[name] = package


def write_data(folder: Path) -> None:
    """The web source's json shards and the code source's MDS shards (written once, before any launch)."""
    from streaming import MDSWriter

    lm.write_web_shards(folder)
    with MDSWriter(out=str(folder / "mds"), columns={"input_ids": "ndarray:int64"},
                             size_limit=1 << 10) as writer:
        for doc in range(lm.DOCS):
            writer.write({"input_ids": np.array(lm.document("code", doc)["input_ids"], dtype=np.int64)})


def pipeline(data: Path) -> Packed:
    from streaming.base.dataset import StreamingDataset

    sources = {"table": [lm.document("table", doc) for doc in range(lm.DOCS)],
               "web": Filtered(lm.web_stream(data), keep),
               "code": StreamingDataset(local=str(data / "mds"), batch_size=lm.BATCH)}
    return Packed(Mixture(sources, lm.WEIGHTS, seed=lm.SEED), seq_len=lm.SEQ_LEN)


def run_link(data: Path, workers: int, chain: Path, index: int, stop: int, tail: int) -> None:
    started = round(time.time(), 2)
    GradientState._reset_state()  # each link is a process of its own in a real run
    accelerator = Accelerator(
        cpu=True,
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
        project_config=ProjectConfiguration(project_dir=str(chain / "run"), automatic_checkpoint_naming=True),
    )
    # No model: the grid judges the data, and a model and optimizer cost every rank 4 CPU-seconds of lazy imports
    # (torch.optim's of torch._dynamo, accelerate's of deepspeed at the first save); test_lm_pipeline_mp trains one.
    # mosaicml-streaming's ranks each look for a free slot of shared memory, then meet: another job on the machine
    # taking that slot between the first rank's look and the last one's makes them disagree and refuse. Met here
    # first, they look within milliseconds of each other.
    accelerator.wait_for_everyone()
    dataset = pipeline(data)
    loader = accelerator.prepare(DataLoader(dataset, batch_size=lm.BATCH, num_workers=workers, drop_last=True))
    steps = lm.Steps()
    accelerator.register_for_checkpointing(steps)
    resumed = accelerator.resume()
    with open(chain / f"launch{index}_rank{accelerator.process_index}.jsonl", "a") as log:
        def record(**entry) -> None:
            log.write(json.dumps({**entry, "time": round(time.time(), 2)}) + "\n")

        record(resumed=None if resumed is None else resumed.name, step=steps.step, world=accelerator.num_processes,
               workers=workers, started=started)
        end = None if stop < 0 else stop + tail
        for batch in loader:
            steps.step += 1
            record(step=steps.step, rows=batch["input_ids"].tolist())
            if steps.step == stop:
                accelerator.save_state()
                record(saved=steps.step)
            if steps.step == end:
                break
        else:
            record(done=steps.step)
    accelerator.wait_for_everyone()


def main(data: Path, plan: Path) -> None:
    light_streaming()
    spec = json.loads(plan.read_text())
    for link in spec["links"]:
        mp_harness_rank.set_aside()  # what the last link left is collected now, on every rank alike
        run_link(data, spec["workers"], Path(link["chain"]), link["index"], link["stop"], link["tail"])
        if dist.is_initialized():
            dist.barrier()


if __name__ == "__main__":
    mp_harness_rank.run(main, Path(sys.argv[1]), Path(sys.argv[2]))
