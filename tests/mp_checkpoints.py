"""Launched as 2 nodes of 1 process each by ``test_checkpoints_mp.py``: checkpoints in folders the ranks do
not share, as on node-local disks.

    accelerate launch --multi_gpu --num_machines 2 --machine_rank R --num_processes 2 ... tests/mp_checkpoints.py OUT

Each process is its node's local main process, so with ``save_on_each_node=True`` each writes the model
into its own folder, as it would on a node-local disk.

Scenarios, in order (each rank appends a verdict per scenario to ``OUT/rank<r>.json``):

1. ``accelerate-data-loop``: Accelerate's own ``test_stateful_dataloader_save_state`` (iterable and
   map-style), which saves into a temporary folder of each process's own, with this package's Accelerator;
2. ``per-process-projects``: automatic naming, ``save_on_each_node=True``, ``total_limit=2``, a project
   folder per node, a model (DDP); one folder misses the newest checkpoint's manifest, and ``resume()``
   must agree on the newest checkpoint complete on both ranks, load its model and continue exactly;
   numbering continues after the newest checkpoint any rank has;
3. ``shared-save-on-each-node``: one folder both nodes share, ``save_on_each_node=True``: one manifest
   listing both ranks, an exact resume;
4. ``main-only-save``: ``if accelerator.is_main_process: accelerator.save_state(...)`` while the other
   rank goes on to a collective; the main process must raise within ``ACCELERATE_STATEFUL_ENTRY_TIMEOUT``
   and the job end (the test requires a non-zero exit and the message).
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch
from accelerate.test_utils.scripts import test_distributed_data_loop as accelerate_loop
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
from torch.utils.data import DataLoader

from accelerate_stateful import Accelerator
from accelerate_stateful.checkpoint import _files

import mp_harness_rank


def stateful(project: Path, **config) -> Accelerator:
    return Accelerator(
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
        project_config=ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True, **config),
    )


def loader(accelerator: Accelerator):
    dl = DataLoader(list(range(40)), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(3))
    return accelerator.prepare(dl)


def accelerate_data_loop(out: Path, rank: int) -> None:
    accelerator = Accelerator()
    accelerate_loop.test_stateful_dataloader_save_state(accelerator)


def per_process_projects(out: Path, rank: int) -> None:
    project = out / f"project_rank{rank}"
    accelerator = stateful(project, total_limit=2, save_on_each_node=True)
    model, dl = accelerator.prepare(torch.nn.Linear(1, 1), loader(accelerator))
    it = iter(dl)
    taken = [next(it).tolist() for _ in range(4)]
    paths = []
    for number in range(3):
        taken.append(next(it).tolist())
        with torch.no_grad():
            model.module.weight.fill_(float(number))
        paths.append(accelerator.save_state())
    rest = [b.tolist() for b in it]
    names = [p.name for p in paths]
    check(names == ["checkpoint_0", "checkpoint_1", "checkpoint_2"], f"saved {names}")
    check(sorted(p.name for p in (project / "checkpoints").iterdir()) == names[1:], "total_limit=2 kept the 2 newest")
    manifest = _files.read_manifest(paths[-1])
    check(manifest["ranks"] == [rank], f"the manifest of rank {rank}'s folder lists ranks {manifest['ranks']}")

    if rank == 1:  # this process's folder misses the newest checkpoint: its save never finished here
        (paths[-1] / _files.SUBDIR / _files.MANIFEST).unlink()
    resumed = accelerator.resume()
    check(resumed is not None and resumed.name == "checkpoint_1", f"resumed from {resumed}")
    check(model.module.weight.item() == 1.0, f"the model of checkpoint_1 was loaded: {model.module.weight.item()}")
    again = [b.tolist() for b in dl]
    check(again == taken[-1:] + rest, f"after resume: {again}, expected {taken[-1:] + rest}")
    following = accelerator.save_state()
    check(following.name == "checkpoint_3", f"the next save is {following.name}, expected checkpoint_3 (after the "
                                             "newest any rank has)")
    check(_files.is_complete(following), f"{following} is complete")


def shared_save_on_each_node(out: Path, rank: int) -> None:
    accelerator = stateful(out / "shared", save_on_each_node=True)
    dl = loader(accelerator)
    it = iter(dl)
    next(it)
    path = accelerator.save_state()
    rest = [b.tolist() for b in it]
    check(_files.read_manifest(path)["ranks"] == [0, 1], "one manifest for the shared folder, listing both ranks")
    check(accelerator.resume() == path, "resumed from the shared checkpoint")
    check([b.tolist() for b in dl] == rest, "exact continuation")


def main_only_save(out: Path, rank: int) -> None:
    accelerator = stateful(out / "main_only")
    loader(accelerator)
    record(out, rank, "main-only-save", True, "entering")
    if accelerator.is_main_process:
        accelerator.save_state()  # the mistake: the other rank never calls it
    accelerator.gather(torch.ones(1))  # where the other rank goes next: a collective


class Failed(Exception):
    pass


def check(condition: bool, what: str) -> None:
    if not condition:
        raise Failed(what)


def record(out: Path, rank: int, name: str, passed: bool, detail: str) -> None:
    path = out / f"rank{rank}.json"
    results = json.loads(path.read_text()) if path.exists() else []
    results.append({"id": name, "passed": passed, "detail": detail})
    path.write_text(json.dumps(results))


SCENARIOS = {
    "accelerate-data-loop": accelerate_data_loop,
    "per-process-projects": per_process_projects,
    "shared-save-on-each-node": shared_save_on_each_node,
}


def main() -> None:
    out = Path(sys.argv[1])
    probe = Accelerator()
    rank = probe.process_index
    torch.manual_seed(rank)  # as Accelerate's own script does
    for name, scenario in SCENARIOS.items():
        try:
            scenario(out, rank)
            record(out, rank, name, True, "")
        except Exception as exc:  # recorded for the test to print, then every rank ends (mp_harness_rank.run)
            record(out, rank, name, False, f"{exc!r}\n{traceback.format_exc()}")
            raise
        probe.wait_for_everyone()
    main_only_save(out, rank)
    probe.end_training()


if __name__ == "__main__":
    mp_harness_rank.run(main)
