"""One launch that writes checkpoints of every loader kind, for the command-line tool's tests.

Run under ``accelerate launch`` by ``test_cli.py``: ``mp_cli.py OUT_DIR``. For each kind it prepares a loader
(a fresh ``Accelerator`` per kind, so each has its own ``dispatch_batches``), takes ``FIRST`` batches, saves
``OUT_DIR/<kind>/a``, takes ``SECOND`` more, saves ``OUT_DIR/<kind>/b``, then reads to the end of the epoch.
Each rank writes ``OUT_DIR/rank<R>.json``: per kind, the sample ids of every batch it took, in order. Then
``RESUMED``: two of those checkpoints resumed at another batch size with samples left out.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from accelerate.state import GradientState
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader

from accelerate_stateful import Accelerator, RoundRobinDataset, TextLines

sys.path.insert(0, str(Path(__file__).parent))
import mp_harness_rank  # noqa: E402
from mp_scenarios import Ids  # noqa: E402
from streams import CountingStream, OpaqueStream, decode  # noqa: E402

FIRST, SECOND = 2, 2


def _lines(root: Path) -> TextLines:
    """Four files of ids as text: four logical shards, each with a byte-offset position."""
    paths = []
    for part in range(4):
        path = root / f"part{part}.txt"
        path.write_text("".join(f"{part * 100 + i}\n" for i in range(9 + part)))
        paths.append(path)
    return TextLines(paths)


def _opaque_source() -> Any:
    """A round-robin source without state_dict: a callable re-opened (and fast-forwarded) on resume."""
    return iter(range(40))


# kind: (dispatch_batches, the DataLoaders to prepare; the first is the one read)
KINDS: dict[str, tuple[bool, Callable[[Path], list]]] = {
    "shard": (False, lambda tmp: [
        DataLoader(Ids(50), batch_size=4, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(3)),
        DataLoader(Ids(23), batch_size=3, drop_last=True),
    ]),
    "dispatcher": (True, lambda tmp: [DataLoader(Ids(45), batch_size=4, shuffle=True)]),
    "stream": (False, lambda tmp: [DataLoader(CountingStream(40), batch_size=3, num_workers=2)]),
    "opaque-stream": (False, lambda tmp: [DataLoader(OpaqueStream(40), batch_size=3)]),
    "round-robin": (True, lambda tmp: [DataLoader(RoundRobinDataset(_opaque_source, transform=decode),
                                                  batch_size=3)]),
    "logical-shards": (False, lambda tmp: [DataLoader(_lines(tmp), batch_size=2, collate_fn=list)]),
}


def _ids(batch: Any) -> list:
    batch = batch["id"] if isinstance(batch, Mapping) else batch
    return batch.tolist() if isinstance(batch, torch.Tensor) else list(batch)


def run_kind(kind: str, out: Path, tmp: Path) -> list[list]:
    dispatch, make = KINDS[kind]
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_stateful_dataloader=True, dispatch_batches=dispatch))
    loaders = accelerator.prepare(*make(tmp))
    loader = loaders[0] if isinstance(loaders, (list, tuple)) else loaders
    taken: list[list] = []
    for batch in loader:
        taken.append(_ids(batch))
        if len(taken) in (FIRST, FIRST + SECOND):
            accelerator.save_state(out / kind / ("a" if len(taken) == FIRST else "b"))
    accelerator.wait_for_everyone()
    return taken


# A checkpoint ``a`` of these kinds resumed in this launch at another batch size, with samples left out:
# (the new batch size of the loader read, the positions of the epoch's order left out). Saved again after one
# batch as ``OUT_DIR/resumed-<kind>/b``.
RESUMED = {"shard": (6, (20, 26)), "dispatcher": (3, (20, 26))}


def run_resumed(kind: str, out: Path, tmp: Path) -> list[list]:
    dispatch, make = KINDS[kind]
    batch, skipped = RESUMED[kind]
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_stateful_dataloader=True, dispatch_batches=dispatch))
    first, *others = make(tmp)
    rebatched = DataLoader(first.dataset, batch_size=batch, shuffle=True, num_workers=first.num_workers,
                           generator=first.generator)
    loader, *_ = accelerator.prepare(rebatched, *others) if others else [accelerator.prepare(rebatched)]
    accelerator.load_state(out / kind / "a")
    loader.skip_samples(*skipped)
    taken = []
    for batch_ids in loader:
        taken.append(_ids(batch_ids))
        if len(taken) == 1:
            accelerator.save_state(out / f"resumed-{kind}" / "b")
    accelerator.wait_for_everyone()
    return taken


def main(out: Path) -> None:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in KINDS:
            results[kind] = run_kind(kind, out, Path(tmp))
        for kind in RESUMED:
            results[f"resumed-{kind}"] = run_resumed(kind, out, Path(tmp))
    from accelerate.state import PartialState

    state = PartialState()
    (out / f"rank{state.process_index}.json").write_text(json.dumps(results))
    state.wait_for_everyone()


if __name__ == "__main__":
    mp_harness_rank.run(main, Path(sys.argv[1]))
