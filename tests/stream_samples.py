"""The harness of the ``samples`` tests of a stream over a composable source (``test_cli_samples_*``): simulated
ranks run to a save point, are resumed from the files on another worker count (the epoch's blocks dealt again)
and run to a second one, and each checkpoint is checked against what the loaders yielded."""

from __future__ import annotations

import random
from typing import Any, Callable, Iterator, Optional

import pytest
from torch.utils.data import DataLoader

from accelerate_stateful import DispatchDataLoader, DistContext, IterableShardDataLoader
from accelerate_stateful.checkpoint import _files

from cli_run import save_checkpoint


def grid_params(grid: list, seed: int, **drawn: list) -> list:
    """A ``pytest.param`` of a config for each ``(ranks, dispatcher, split_batches, workers before and after the
    resume, below, predicate)`` of ``grid``, with a seed, two save points, and a value of each ``drawn`` setting."""
    rng = random.Random(seed)
    found = []
    for world, dispatch, split, workers, below, keep in grid:
        cfg = dict(world=world, seed=rng.randrange(1000), dispatch=dispatch, split=split, workers=workers,
                   below=below, keep=keep, stops=sorted(rng.sample(range(1, 7), 2)), bs=2 * world if split else 2)
        cfg.update({name: rng.choice(values) for name, values in drawn.items()})
        name = f"world{world}-{'dispatch' if dispatch else 'shard'}{'-split' if split else ''}-workers{workers[0]}to" \
               f"{workers[1]}-{below}-{keep.__name__}"
        found.append(pytest.param(cfg, id=name))
    return found


def stream_loader(dataset: Any, cfg: dict, rank: int, workers: int):
    """Rank ``rank``'s loader of ``cfg`` (``world``, ``bs``, ``dispatch``, ``split``) over ``dataset``."""
    dl = DataLoader(dataset, batch_size=cfg["bs"], num_workers=workers)
    build = DispatchDataLoader if cfg["dispatch"] else IterableShardDataLoader
    return build.from_dataloader(dl, DistContext(rank, cfg["world"]), split_batches=cfg["split"])


def run_steps(loaders: list, steps: int, passes: list) -> list[list[list]]:
    """Each rank's next ``steps`` batches as lists (a packer's: its rows' tokens); the passes stay live for the
    save."""
    passes += [iter(loader) for loader in loaders]
    batches = [[next(it) for _ in range(steps)] for it in passes[-len(loaders):]]
    return [[(b["input_ids"] if isinstance(b, dict) else b).tolist() for b in rank] for rank in batches]


def saved_after(tmp_path, source: Any, steps: int = 3, world: int = 1, skip: Optional[tuple[int, int]] = None,
                **loader: Any) -> tuple[Any, list]:
    """A checkpoint of ``world`` shard loaders over ``source`` (batch size 2 unless ``loader`` says; ``skip``: the
    rows ``skip_samples`` leaves out first) after ``steps`` steps, and the batches they took (:func:`run_steps`)."""
    loaders = [IterableShardDataLoader.from_dataloader(DataLoader(source, **{"batch_size": 2, **loader}),
                                                       DistContext(r, world)) for r in range(world)]
    for each in loaders if skip else ():
        each.skip_samples(*skip)
    taken = run_steps(loaders, steps, [])
    return save_checkpoint(tmp_path / "ckpt", [[each.state_dict() for each in loaders]]), taken


def checked_across_a_resume(tmp_path, cfg: dict, loader: Callable[[dict, int, int], Any],
                            check: Callable[[Any, list, dict], None]) -> None:
    """``cfg``'s ranks (``loader(cfg, rank, workers)``) run to the first of ``cfg["stops"]`` on the first of
    ``cfg["workers"]``, resumed from the files on the second and run on; ``check(checkpoint, batches taken per
    rank, cfg)`` at each save point."""
    world, (first, second) = cfg["world"], cfg["stops"]
    loaders = [loader(cfg, r, cfg["workers"][0]) for r in range(world)]
    passes: list = []
    taken = run_steps(loaders, first, passes)
    ckpt = save_checkpoint(tmp_path / "first", [[each.state_dict() for each in loaders]])
    check(ckpt, taken, cfg)

    resumed = [loader(cfg, r, cfg["workers"][1]) for r in range(world)]
    for rank, each in enumerate(resumed):
        each.load_state_dict(_files.read_loader_state(ckpt, 0, rank))
    more = run_steps(resumed, second, passes)
    both = [taken[r] + more[r] for r in range(world)]
    check(save_checkpoint(tmp_path / "second", [[each.state_dict() for each in resumed]]), both, cfg)


def answers(out: dict, taken: list, cfg: dict) -> Iterator[tuple[dict, list, bool]]:
    """Each step's answer of every rank in ``samples --consumed --json`` output ``out``, step by step: the answer,
    the rows it names (the rank's, or every rank's in rank order where it is for all ranks), and whether it is
    the one to count in the steps' global order (each rank's where each rank's part is named, else rank 0's)."""
    for step in range(len(taken[0])):
        for rank, found in enumerate(out["ranks"]):
            answer = found["batches"][step]
            assert answer["step"] == step
            rows = taken[rank][step] if answer["rows"] == "this rank" else \
                [row for r in range(cfg["world"]) for row in taken[r][step]]
            yield answer, rows, answer["rows"] == "this rank" or rank == 0


def check_scopes(out: dict, cfg: dict) -> None:
    """Where the dispatcher hands each rank a whole block, each rank's part is named on its own; else the step's."""
    scopes = {b["rows"] for found in out["ranks"] for b in found["batches"]}
    assert scopes == ({"this rank"} if cfg["world"] == 1 or (cfg["dispatch"] and not cfg["split"]) else {"all ranks"})
