"""Bad input to ``accelerate-stateful``: one clear line on stderr, a documented status, nothing unpickled.

Checkpoints here are written by ranks simulated in this process (``test_cli.py`` uses real processes).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from accelerate_stateful import DistContext, ShardDataLoader
from accelerate_stateful.checkpoint import _files

from cli_run import run_cli, save_checkpoint

SUB = _files.SUBDIR


def _state(rank: int, world: int = 2) -> dict:
    """A rank's state one batch into its epoch, taken while the pass is live (a dropped pass is undone)."""
    loader = ShardDataLoader.from_dataloader(DataLoader(list(range(20)), batch_size=2, shuffle=True),
                                             DistContext(rank, world), data_seed=4)
    it = iter(loader)
    next(it)
    return loader.state_dict()


@pytest.fixture
def ckpt(tmp_path) -> Path:
    return save_checkpoint(tmp_path / "checkpoint_3", [[_state(r) for r in range(2)]])


def _one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("accelerate-stateful: error: "), err
    return lines[0]


def _rewrite_state(ckpt: Path, rank: int, **changes) -> None:
    """Edit a loader state and re-seal the manifest, as a writer of another version would have written it."""
    path = _files.state_file(ckpt, 0, rank)
    state = json.loads(path.read_text())
    state.update(changes)
    path.write_text(json.dumps(state))
    _files.write_manifest(ckpt, world_size=2, num_loaders=1)


@pytest.mark.parametrize("command", ["inspect", "verify", "samples", "diff"])
@pytest.mark.parametrize("target, message", [
    ("missing", "does not exist"),
    ("file", "is a file, not a checkpoint folder"),
    ("plain", "is not an accelerate-stateful checkpoint: it has no accelerate_stateful/ folder"),
    ("root", "it holds checkpoint folders, pass one of them, e.g."),
])
def test_a_path_that_is_not_a_checkpoint_gives_one_line_and_status_3(tmp_path, ckpt, command, target, message):
    paths = {"missing": tmp_path / "nope", "file": ckpt / SUB / _files.MANIFEST, "plain": tmp_path / "plain",
             "root": tmp_path}
    (tmp_path / "plain").mkdir()
    args = {"samples": ["--remaining"], "diff": [ckpt]}.get(command, [])
    status, out, err = run_cli(command, paths[target], *args)
    assert status == 3 and out == ""
    assert message in _one_error_line(err)


@pytest.mark.parametrize("command", ["inspect", "verify", "samples", "diff"])
@pytest.mark.parametrize("damage, message", [
    ("manifest_version", "manifest_version=2, this accelerate-stateful reads up to 1"),
    ("format_version", "has format_version=2, which this release cannot read (written by a newer release"),
    ("mode", "unknown mode 'interleaved'"),
])
def test_a_checkpoint_of_a_newer_release_is_refused_with_upgrade(ckpt, command, damage, message):
    if damage == "manifest_version":
        path = ckpt / SUB / _files.MANIFEST
        path.write_text(json.dumps({**json.loads(path.read_text()), "manifest_version": 2}))
    else:
        _rewrite_state(ckpt, 1, **{damage: 2 if damage == "format_version" else "interleaved"})
    args = {"samples": ["--remaining"], "diff": [ckpt]}.get(command, [])
    status, out, err = run_cli(command, ckpt, *args)
    line = _one_error_line(err)
    assert status == 3 and out == "" and message in line and "upgrade" in line


def test_verify_lists_every_damaged_missing_or_foreign_file_with_the_fix(ckpt):
    (ckpt / SUB / "loader_0.rank_0.json").write_text("{")  # truncated
    (ckpt / SUB / "loader_0.rank_1.json").unlink()
    (ckpt / SUB / "loader_7.rank_0.json").write_text("{}")  # not written by this save
    status, out, err = run_cli("verify", ckpt)
    assert status == 1 and err == ""
    problems = [line for line in out.splitlines() if line.startswith("PROBLEM ")]
    files = {line.split()[1].rstrip(":") for line in problems}
    assert {f"{SUB}/loader_0.rank_0.json", f"{SUB}/loader_0.rank_1.json", f"{SUB}/loader_7.rank_0.json"} <= files
    assert all("resume from another checkpoint" in line or "remove it" in line for line in problems), out
    assert out.splitlines()[-1].startswith(f"INCOMPLETE {ckpt}:")


def test_an_interrupted_save_is_shown_as_incomplete_and_refused_for_samples(ckpt):
    (ckpt / SUB / _files.MANIFEST).unlink()
    status, out, err = run_cli("inspect", ckpt, "--json")
    report = json.loads(out)
    assert status == 1 and not report["complete"] and report["manifest_version"] is None
    assert report["manifest_problem"] == "missing"
    assert "has no accelerate_stateful/MANIFEST.json" in report["problems"][0]["message"]
    assert [r["batches_taken"] for r in report["loaders"][0]["ranks"]] == [1, 1]  # what is there is shown
    _says_incomplete_once(_one_error_line(err), ckpt)
    assert run_cli("verify", ckpt)[0] == 1
    status, out, err = run_cli("samples", ckpt, "--remaining")
    assert status == 3 and out == "" and "run 'accelerate-stateful verify'" in _one_error_line(err)
    _says_incomplete_once(_one_error_line(err), ckpt)


def _says_incomplete_once(line: str, ckpt: Path) -> None:
    """The checkpoint is named once, and its state said once ("X is incomplete or damaged: X is incomplete" was not)."""
    assert line.count(str(ckpt)) == 1 and line.count("incomplete") <= 1, line
    assert "incomplete" in line or "damaged" in line, line


def test_a_position_that_a_resume_would_refuse_is_reported_in_the_loaders_words(ckpt):
    _rewrite_state(ckpt, 0, samples_consumed=5)  # not a step boundary of 4 samples per step
    status, out, err = run_cli("inspect", ckpt)
    assert status == 3 and out == "" and "inconsistent position" in _one_error_line(err)
    status, out, _ = run_cli("verify", ckpt)
    assert status == 1 and "inconsistent position" in out


def test_nothing_in_a_checkpoint_is_ever_unpickled(ckpt, tmp_path):
    marker = tmp_path / "unpickled"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    bomb = pickle.dumps(Payload())
    (ckpt / "random_states_0.pkl").write_bytes(bomb)  # Accelerate's own files are listed, never opened
    _files.write_manifest(ckpt, world_size=2, num_loaders=1)
    (ckpt / SUB / "loader_0.rank_1.json").write_bytes(bomb)
    for command in (["inspect"], ["verify"], ["samples", "--remaining"], ["diff", ckpt]):
        status, _, _ = run_cli(command[0], ckpt, *command[1:])
        assert status in (1, 3)
    assert not marker.exists()
    status, out, _ = run_cli("verify", ckpt)
    assert f"PROBLEM {SUB}/loader_0.rank_1.json: " in out and "resume from another checkpoint" in out


@pytest.mark.parametrize("text", ["{", json.dumps({"world_size": 2, "num_loaders": 1, "files": {}}),
                                  json.dumps({"manifest_version": 1, "world_size": 2, "num_loaders": 1,
                                              "files": {"x": 3}})])
def test_a_damaged_manifest_makes_the_checkpoint_incomplete(ckpt, text):
    (ckpt / SUB / _files.MANIFEST).write_text(text)
    status, out, err = run_cli("verify", ckpt)
    assert status == 1 and f"PROBLEM {SUB}/{_files.MANIFEST}: " in out and "resume from an" in out
    status, out, err = run_cli("inspect", ckpt)
    assert status == 1 and "damaged" in _one_error_line(err)
    assert _one_error_line(err).count(str(ckpt)) == 1
    header = out.splitlines()[1]
    assert header.startswith("complete    NO (the manifest is damaged, see the problems below")
    assert "None" not in header, header  # not "manifest version None"
    report = json.loads(run_cli("inspect", ckpt, "--json")[1])
    assert report["manifest_problem"] == "damaged" and report["manifest_version"] is None


def test_a_checkpoint_with_several_problems_names_the_first_and_points_to_verify_for_the_rest(ckpt):
    for rank in (0, 1):
        path = _files.state_file(ckpt, 0, rank)
        path.write_text(path.read_text() + " ")  # sizes no longer match the manifest
    status, _, err = run_cli("inspect", ckpt)
    line = _one_error_line(err)
    assert status == 1 and line.count(str(ckpt)) == 2 and "loader_0.rank_0.json" in line  # the file, and verify's
    assert f"(1 more: 'accelerate-stateful verify {ckpt}' lists every problem)" in line


def test_a_damaged_stream_position_is_refused_in_one_line(tmp_path):
    from accelerate_stateful import IterableShardDataLoader
    from streams import CountingStream

    loader = IterableShardDataLoader.from_dataloader(DataLoader(CountingStream(10), batch_size=2), DistContext(0, 1))
    state = loader.state_dict()
    del state["stream"]["taken"]
    ckpt = save_checkpoint(tmp_path / "stream", [[state]])
    status, out, err = run_cli("inspect", ckpt)
    assert status == 3 and out == "" and "the stream position is damaged" in _one_error_line(err)


def test_a_user_batch_sampler_is_inspected_and_samples_says_it_needs_the_sampler(tmp_path):
    from torch.utils.data import BatchSampler, RandomSampler

    from accelerate_stateful import BatchSamplerDataLoader

    def taken(rank: int) -> dict:
        sampler = BatchSampler(RandomSampler(range(20), generator=__import__("torch").Generator()), 3, False)
        loader = BatchSamplerDataLoader.from_dataloader(DataLoader(range(20), batch_sampler=sampler),
                                                        DistContext(rank, 2), data_seed=1)
        it = iter(loader)
        next(it)
        return loader.state_dict()

    ckpt = save_checkpoint(tmp_path / "checkpoint_1", [[taken(r) for r in range(2)]])
    status, out, err = run_cli("inspect", ckpt, "--json")
    assert status == 0, err
    report = json.loads(out)
    assert report["loaders"][0]["kind"] == "batch-sampler"
    assert [r["epoch"] for r in report["loaders"][0]["ranks"]] == [0, 0]
    status, out, err = run_cli("samples", ckpt, "--remaining")
    assert status == 4 and "sampler" in err, (status, err)


@pytest.mark.parametrize("command", ["inspect", "verify", "samples", "diff"])
def test_the_project_folder_gets_did_you_mean_its_checkpoints_folder(tmp_path, command):
    project = tmp_path / "project"
    for number in (2, 3):
        save_checkpoint(project / "checkpoints" / f"checkpoint_{number}", [[_state(r) for r in range(2)]])
    (project / "checkpoints" / "checkpoint_3" / SUB / _files.MANIFEST).unlink()  # the newest save was cut short
    args = {"samples": ["--remaining"], "diff": [project]}.get(command, [])
    status, out, err = run_cli(command, project, *args)
    line = _one_error_line(err)
    assert status == 3 and out == ""
    assert f"did you mean {project / 'checkpoints'}?" in line
    assert f"the newest complete one is {project / 'checkpoints' / 'checkpoint_2'}" in line
