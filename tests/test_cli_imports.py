"""``inspect``, ``verify`` and ``diff`` read a checkpoint without importing torch or accelerate.

Importing torch is most of a call's time (seconds; ``docs/cli.md`` has the figures), and reading JSON
files and safetensors headers needs neither. Each command runs as the real ``python -m accelerate_stateful``
with ``-X importtime``, whose report on stderr names every module the process imported. ``samples`` of a shard
loader or a dispatcher needs no torch either; of a loader whose order a user's own sampler draws, which it
rebuilds (to refuse it), it shows the same report does list torch when it is imported.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from torch.utils.data import DataLoader, SequentialSampler

from accelerate_stateful import DispatchDataLoader, DistContext, IterableShardDataLoader, ShardDataLoader
from accelerate_stateful.checkpoint import _files

from cli_run import run_cli, run_importtime, run_subprocess, save_checkpoint
from streams import CountingStream

HEAVY = ("torch", "accelerate", "numpy")


def _taken(loader, batches: int = 2) -> dict:
    it = iter(loader)
    for _ in range(batches):
        next(it)
    return loader.state_dict()


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A project folder whose checkpoint holds a shard loader, a dispatcher (whose state has tensors) and a
    stream, each on 2 simulated ranks."""
    root = tmp_path_factory.mktemp("project")
    loaders = [
        [_taken(ShardDataLoader.from_dataloader(DataLoader(range(20), batch_size=2, shuffle=True),
                                                DistContext(r, 2), data_seed=1)) for r in range(2)],
        [_taken(DispatchDataLoader.from_dataloader(DataLoader(range(20), batch_size=3), DistContext(r, 2)))
         for r in range(2)],
        [_taken(IterableShardDataLoader.from_dataloader(DataLoader(CountingStream(40), batch_size=2),
                                                        DistContext(r, 2))) for r in range(2)],
    ]
    for number in (1, 2):
        save_checkpoint(root / "checkpoints" / f"checkpoint_{number}", loaders)
    assert list((root / "checkpoints" / "checkpoint_1" / _files.SUBDIR).glob("*.safetensors"))
    return root


_imported = run_importtime


def _damaged(project: Path, tmp_path: Path) -> Path:
    copy = Path(shutil.copytree(project / "checkpoints" / "checkpoint_2", tmp_path / "checkpoint_2"))
    path = _files.state_file(copy, 1, 0)
    path.write_text(path.read_text() + " ")
    return copy


@pytest.mark.parametrize("command, expected", [
    pytest.param(lambda p, t: ("inspect", p / "checkpoints" / "checkpoint_2"), 0, id="inspect"),
    pytest.param(lambda p, t: ("inspect", p / "checkpoints" / "checkpoint_2", "--json"), 0, id="inspect-json"),
    pytest.param(lambda p, t: ("verify", p / "checkpoints" / "checkpoint_2"), 0, id="verify"),
    pytest.param(lambda p, t: ("diff", p / "checkpoints" / "checkpoint_1", p / "checkpoints" / "checkpoint_2"), 0,
                 id="diff"),
    pytest.param(lambda p, t: ("verify", _damaged(p, t)), 1, id="verify-damaged"),
    pytest.param(lambda p, t: ("inspect", _damaged(p, t)), 1, id="inspect-damaged"),
    pytest.param(lambda p, t: ("inspect", p), 3, id="the-project-folder"),
])
def test_reading_a_checkpoint_imports_neither_torch_nor_accelerate(project, tmp_path, command, expected):
    args = command(project, tmp_path)
    status, imported, out = _imported(*args)
    assert "accelerate_stateful" in imported and status == expected
    assert not imported & set(HEAVY), f"imported {sorted(imported & set(HEAVY))}"
    if args[-1] == "--json":
        assert [loader["kind"] for loader in json.loads(out)["loaders"]] == ["shard", "dispatcher", "stream"]


@pytest.mark.parametrize("args", [
    pytest.param(("--remaining",), id="remaining"),
    pytest.param(("--consumed", "--rank", "1"), id="consumed"),
    pytest.param(("--step", "3", "--json"), id="step"),
    pytest.param(("--remaining", "--world-size", "3"), id="elastic"),
    pytest.param(("--loader", "2", "--step", "0"), id="a-stream-is-refused"),
])
def test_samples_of_a_shuffled_shard_loader_or_a_stream_import_neither_torch_nor_accelerate(project, args):
    """Issue 26: ``samples`` took 5.6-8.2 s, nearly all of it importing torch, though a shard loader's batches
    follow from its state (the order is drawn again without torch: ``cli/_indices``), on the saved number of
    processes or another."""
    status, imported, out = _imported("samples", project / "checkpoints" / "checkpoint_2", *args)
    stream = args[:2] == ("--loader", "2")
    assert status == (4 if stream else 0) and (stream or out.startswith(("# loader 0", "{")))
    assert not imported & set(HEAVY), f"imported {sorted(imported & set(HEAVY))}"


@pytest.mark.parametrize("args", [
    pytest.param(("--remaining",), id="remaining"),
    pytest.param(("--consumed", "--rank", "1"), id="consumed"),
    pytest.param(("--step", "3", "--json"), id="step"),
    pytest.param(("--remaining", "--world-size", "3"), id="elastic"),
])
def test_samples_of_a_dispatcher_import_neither_torch_nor_accelerate(project, args):
    """Issue 26: ``samples`` of a dispatcher rebuilt it and ran it over the dataset's indices, 2.6-3 s at least,
    though its steps follow from its state (``cli/_dispatched``); the answer is the one the tests hold against the
    loaders, in this process."""
    ckpt = project / "checkpoints" / "checkpoint_2"
    status, imported, out = _imported("samples", ckpt, "--loader", "1", *args)
    assert (status, out) == run_cli("samples", ckpt, "--loader", "1", *args)[:2]
    assert status == 0 and out.startswith(("# loader 1, rank", "{"))
    assert not imported & set(HEAVY), f"imported {sorted(imported & set(HEAVY))}"


def test_samples_refuse_an_order_drawn_by_a_users_sampler_without_importing_torch(tmp_path):
    """Such an order is refused from the state, before anything would rebuild the loader."""
    class Reversed(SequentialSampler):
        def __iter__(self):
            return iter(range(len(self.data_source) - 1, -1, -1))

    data = list(range(12))
    for dispatch in (False, True):
        made = DataLoader(data, batch_size=4, sampler=Reversed(data))
        loader = (DispatchDataLoader.from_dataloader(made, DistContext(0, 1)) if dispatch
                  else ShardDataLoader.from_dataloader(made, DistContext(0, 1)))
        ckpt = save_checkpoint(tmp_path / f"c{dispatch}", [[loader.state_dict()]])
        status, imported, _ = _imported("samples", ckpt, "--remaining")
        assert status == 4 and not imported & set(HEAVY), (status, sorted(imported & set(HEAVY)))
        assert "the DataLoader's own sampler (sampler:" in run_cli("samples", ckpt, "--remaining")[2]


def test_samples_of_an_epoch_longer_than_the_order_drawn_here_rebuild_the_loader_and_so_import_torch(tmp_path):
    """The report does list torch where it is imported: above ``_indices.MAX_SAMPLES`` the loaders answer."""
    from accelerate_stateful.cli import _indices

    loader = ShardDataLoader.from_dataloader(DataLoader(range(_indices.MAX_SAMPLES + 1), batch_size=4), DistContext(0, 1))
    status, imported, out = _imported("samples", save_checkpoint(tmp_path / "c", [[loader.state_dict()]]), "--step", "0")
    assert status == 0 and out.splitlines()[-1] == "step 0: 0 1 2 3" and "torch" in imported, (status, out)


def test_a_training_process_does_not_import_distributed_checkpoint_at_start():
    """Every process of a run imports this package: ``torch.distributed.checkpoint`` (and with it
    ``torch.distributed.tensor``, sympy) cost about 2 s of each start, though only a DCP save needs them. The
    loaders are still DCP ``Stateful`` objects: the protocol is structural."""
    program = ("import sys; from accelerate_stateful import Accelerator; "
               "import torch; from torch.utils.data import DataLoader; "
               "acc = Accelerator(cpu=True); dl = acc.prepare(DataLoader(list(range(8)), batch_size=2)); "
               "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.checkpoint'))); "
               "from torch.distributed.checkpoint.stateful import Stateful; print(isinstance(dl, Stateful))")
    done = run_subprocess([sys.executable, "-c", program])
    assert done.stdout.split() == ["[]", "True"], done.stdout + done.stderr
