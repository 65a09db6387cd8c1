"""The ``accelerate-stateful`` command line on checkpoints written by a real 2-process run of every loader kind.

One ``accelerate launch`` (``mp_cli.py``) saves two checkpoints per kind: shard (with a second, untouched
loader), dispatcher, stateful stream, opaque stream, round-robin and logical shards, and records every batch
each rank took. Every command runs once as a real ``python -m accelerate_stateful`` subprocess, once through
the entry point ``setup.py`` declares, and in this process for breadth.
"""

from __future__ import annotations

import ast
import importlib
import itertools
import json
import pickle
import shutil
import sys
from pathlib import Path

import pytest

from accelerate_stateful.checkpoint import _files
from accelerate_stateful import __main__ as module_main
from accelerate_stateful.cli._main import main

from cli_run import REPO, cli_json, run_cli, run_module, run_subprocess
import mp_harness

sys.path.insert(0, str(Path(__file__).parent))
import mp_cli  # noqa: E402

WORLD = 2
STREAMS = ("stream", "opaque-stream", "round-robin", "logical-shards")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """The checkpoints and per-rank batches of one real 2-process launch."""
    out = tmp_path_factory.mktemp("cli_launch")
    done = mp_harness.launch(mp_harness.accelerate_command(Path(mp_cli.__file__), [out], WORLD), out / "launch",
                             timeout_s=300, watch=[out], HF_HOME=str(out / "hf_home"))
    assert done.ok, done.report()
    return out


def _taken(run_dir: Path, kind: str, rank: int) -> list:
    return json.loads((run_dir / f"rank{rank}.json").read_text())[kind]


# --------------------------------------------------------------------------- the real command line
@pytest.mark.multiprocess
def test_every_command_runs_as_python_dash_m(run_dir, tmp_path):
    shard, logical = run_dir / "shard", run_dir / "logical-shards"
    inspect = run_module("inspect", shard / "b", "--json")
    assert inspect.returncode == 0, inspect.stderr
    assert [l["kind"] for l in json.loads(inspect.stdout)["loaders"]] == ["shard", "shard"]
    damaged = Path(shutil.copytree(run_dir / "dispatcher" / "b", tmp_path / "damaged"))
    marker = tmp_path / "unpickled"
    (damaged / "random_states_1.pkl").write_bytes(pickle.dumps(_Bomb(marker)))  # Accelerate's: never opened
    state = damaged / _files.SUBDIR / "loader_0.rank_1.json"
    state.write_bytes(state.read_bytes()[:-3])
    verify = run_module("verify", damaged)
    problems = [line.split()[1] for line in verify.stdout.splitlines() if line.startswith("PROBLEM ")]
    assert verify.returncode == 1 and verify.stderr == "", verify.stdout + verify.stderr
    assert set(problems) == {"random_states_1.pkl:", f"{_files.SUBDIR}/loader_0.rank_1.json:"}, verify.stdout
    assert not marker.exists()
    samples = run_module("samples", shard / "a", "--remaining", "--rank", 1, "--json")
    assert samples.returncode == 0, samples.stderr
    printed = [b["indices"] for b in json.loads(samples.stdout)["ranks"][0]["batches"]]
    assert printed == _taken(run_dir, "shard", 1)[mp_cli.FIRST:]
    diff = run_module("diff", logical / "a", logical / "b")
    assert diff.returncode == 0 and "logical shard positions moved" in diff.stdout, diff.stdout + diff.stderr


@pytest.mark.multiprocess
def test_the_console_script_declared_in_setup_py_is_the_main_function_and_runs(run_dir):
    declared = _console_scripts()
    assert list(declared) == ["accelerate-stateful"]
    module, function = declared["accelerate-stateful"].split(":")
    assert getattr(importlib.import_module(module), function) is main and module_main.main is main
    # What the installed accelerate-stateful executable does: import the declared function, exit with its result.
    script = f"import sys, importlib; sys.exit(importlib.import_module({module!r}).{function}())"
    done = run_subprocess([sys.executable, "-c", script, "inspect", run_dir / "stream" / "b"])
    assert done.returncode == 0, done.stderr
    assert "stream" in done.stdout and "complete    yes" in done.stdout


class _Bomb:
    """A pickle that, if anything loaded it, would create ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _console_scripts() -> dict:
    tree = ast.parse((REPO / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    entry_points = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "entry_points"))
    return dict(line.replace(" ", "").split("=", 1) for line in entry_points["console_scripts"])


# --------------------------------------------------------------------------- every kind, in this process
@pytest.mark.multiprocess
@pytest.mark.parametrize("kind, reads, workers, replayed", [
    ("shard", None, 2, None), ("dispatcher", "shard", 0, None), ("stream", None, 2, 0),
    ("opaque-stream", None, 0, 3 * WORLD * (mp_cli.FIRST + mp_cli.SECOND)),  # each rank reads every global batch
    ("round-robin", "round-robin", 0, 3 * WORLD * (mp_cli.FIRST + mp_cli.SECOND)), ("logical-shards", None, 0, 0),
])
def test_inspect_reports_every_kind_on_every_rank(run_dir, kind, reads, workers, replayed):
    report = cli_json("inspect", run_dir / kind / "b")
    assert report["schema_version"] == 1 and report["complete"] and report["problems"] == []
    assert report["manifest_version"] == _files.MANIFEST_VERSION and report["world_size"] == WORLD
    loader = report["loaders"][0]
    expected_kind = {"opaque-stream": "stream", "logical-shards": "stream", "round-robin": "dispatcher"}
    assert (loader["kind"], loader["reads"], loader["format_version"]) == (expected_kind.get(kind, kind), reads, 1)
    assert [r["rank"] for r in loader["ranks"]] == [0, 1]
    for row in loader["ranks"]:
        assert (row["epoch"], row["batches_taken"], row["workers"]) == (0, mp_cli.FIRST + mp_cli.SECOND, workers)
        assert row["replayed_samples"] == replayed
        assert row["seed_source"] in ("generator", "drawn") and isinstance(row["seed"], int)
        if kind in STREAMS:
            assert (row["batches_in_epoch"], row["samples_consumed"]) == (None, None)
        else:
            assert row["batches_in_epoch"] == len(_taken(run_dir, kind, row["rank"]))
            assert row["samples_consumed"] == 8 * (mp_cli.FIRST + mp_cli.SECOND)
            progress = row["samples_consumed"] / loader["config"]["num_samples"] if kind == "shard" else (
                row["batches_taken"] / row["batches_in_epoch"])  # each loader's own progress()
            assert row["epoch_fraction"] == pytest.approx(progress)
    shards = [row["logical_shards"] for row in loader["ranks"]]
    if kind == "logical-shards":  # rank r owns files r and r + 2; two lines of 4 bytes read from each per batch
        assert [sorted(s["positions"]) for s in shards] == [["0", "2"], ["1", "3"]]
    else:
        assert shards == [None, None]


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["shard", "dispatcher"])
def test_samples_of_real_checkpoints_are_the_batches_each_rank_took_and_takes(run_dir, kind):
    for save, taken in (("a", mp_cli.FIRST), ("b", mp_cli.FIRST + mp_cli.SECOND)):
        consumed = cli_json("samples", run_dir / kind / save, "--consumed")
        remaining = cli_json("samples", run_dir / kind / save, "--remaining")
        for rank in range(WORLD):
            truth = _taken(run_dir, kind, rank)
            assert [b["indices"] for b in consumed["ranks"][rank]["batches"]] == truth[:taken]
            assert [b["indices"] for b in remaining["ranks"][rank]["batches"]] == truth[taken:]
            last = len(truth) - 1
            step = cli_json("samples", run_dir / kind / save, "--rank", rank, "--step", last)
            assert step["ranks"][0]["batches"] == [{"step": last, "indices": truth[last]}]


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", list(mp_cli.RESUMED))
def test_a_real_checkpoint_resumed_at_another_batch_size_leaves_the_skipped_samples_out(run_dir, kind):
    """Saved after 2 steps of 8 samples, resumed in the launch at another batch size with positions 20-25 left
    out: the rest is the epoch's order from 16 without them, cut at the new size; inspect and samples agree."""
    batch, (start, stop) = mp_cli.RESUMED[kind]

    def in_step_order(per_rank):
        return [i for step in itertools.zip_longest(*per_rank, fillvalue=[]) for b in step for i in b]

    full = [_taken(run_dir, kind, rank) for rank in range(WORLD)]
    resumed = [_taken(run_dir, f"resumed-{kind}", rank) for rank in range(WORLD)]
    length = len(set(in_step_order(full)))
    order = in_step_order(full)[:length]
    expected = order[8 * mp_cli.FIRST: start] + order[stop:]
    delivered = in_step_order(resumed)
    assert delivered[: len(expected)] == expected and set(delivered[len(expected):]) <= set(order)
    assert all(len(b) == batch for r in resumed for b in r[:-1])
    report = cli_json("inspect", run_dir / f"resumed-{kind}" / "b")
    rows = report["loaders"][0]["ranks"]
    assert [row["skipped_samples"] for row in rows] == [[[0, start, stop]]] * WORLD
    assert [row["samples_in_epoch"] for row in rows] == [length - (stop - start)] * WORLD
    remaining = cli_json("samples", run_dir / f"resumed-{kind}" / "b", "--remaining")
    assert [[b["indices"] for b in r["batches"]] for r in remaining["ranks"]] == [r[1:] for r in resumed]


@pytest.mark.multiprocess
def test_samples_of_a_second_untouched_loader_start_at_its_epochs_first_batch(run_dir):
    printed = cli_json("samples", run_dir / "shard" / "b", "--loader", 1, "--remaining")
    per_rank = [[b["indices"] for b in r["batches"]] for r in printed["ranks"]]
    assert per_rank == [[[0, 1, 2], [6, 7, 8], [12, 13, 14]], [[3, 4, 5], [9, 10, 11], [15, 16, 17]]]


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", STREAMS)
def test_samples_of_a_stream_say_it_has_no_indices(run_dir, kind):
    status, out, err = run_cli("samples", run_dir / kind / "b", "--remaining")
    assert status == 4 and out == "" and "reads a stream" in err and len(err.splitlines()) == 1


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", list(mp_cli.KINDS))
def test_diff_of_two_saves_names_every_position_that_moved(run_dir, kind):
    changes = cli_json("diff", run_dir / kind / "a", run_dir / kind / "b")["changes"]
    moved = {(c["what"], c["rank"]): (c["a"], c["b"]) for c in changes}
    for rank in range(WORLD):
        assert moved[("batches taken", rank)] == (mp_cli.FIRST, mp_cli.FIRST + mp_cli.SECOND)
    assert all(c["loader"] == 0 and c["rank"] is not None for c in changes), changes  # nothing else changed
    assert verify_ok(run_dir / kind / "a") and verify_ok(run_dir / kind / "b")


def verify_ok(path: Path) -> bool:
    status, out, _ = run_cli("verify", path)
    return status == 0 and out.startswith("OK ")


@pytest.mark.multiprocess
def test_diff_names_a_change_of_topology_and_settings(run_dir, tmp_path):
    status, out, _ = run_cli("diff", run_dir / "shard" / "a", run_dir / "dispatcher" / "b")
    assert status == 0
    assert "loaders: 2 -> 1" in out and "loader 0: kind: shard -> dispatcher" in out
    assert "loader 0: dataset_length: 50 -> 45" in out and "loader 0 rank 0: batches taken: 2 -> 4" in out


def test_diff_names_a_change_of_world_size_epoch_and_ranks_only_in_one(tmp_path):
    from torch.utils.data import DataLoader

    from accelerate_stateful import DistContext, ShardDataLoader

    from cli_run import save_checkpoint

    def saved(world: int, epoch: int, batches: int, name: str) -> Path:
        states = []
        for rank in range(world):
            dl = DataLoader(list(range(30)), batch_size=2)
            loader = ShardDataLoader.from_dataloader(dl, DistContext(rank, world))
            loader.set_epoch(epoch)
            loader.seek(batches)
            states.append(loader.state_dict())
        return save_checkpoint(tmp_path / name, [states])

    status, out, err = run_cli("diff", saved(2, 0, 3, "a"), saved(3, 1, 1, "b"))
    assert status == 0 and err == ""
    for line in ("world size: 2 -> 3", "loader 0 rank 0: epoch: 0 -> 1", "loader 0 rank 0: batches taken: 3 -> 1",
                 "loader 0 rank 0: samples consumed: 12 -> 6", "loader 0 rank 2: only in B"):
        assert line in out.splitlines(), out
