"""Safe state files: JSON plus safetensors, nothing unpickled, manifests, finding the latest checkpoint."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from accelerate_stateful import CheckpointError, StateSerializationError, latest_checkpoint
from accelerate_stateful.checkpoint import _files


def test_a_state_tree_round_trips_with_its_types():
    state = {
        "n": 3, "f": 0.5, "s": "x", "b": True, "none": None, "list": [1, [2, 3]], "tuple": (1, (2, "a")),
        "bytes": b"\x00\xff", "int_keys": {0: "a", 1: {"deep": torch.arange(3)}},
        "gen": torch.Generator().manual_seed(5).get_state(),
        "looks_like_marker": {"__tensor__": "t0", "other": 1},
    }
    tree, tensors = _files.encode(state)
    json.dumps(tree)  # the tree is plain JSON
    back = _files.decode(json.loads(json.dumps(tree)), tensors)
    assert torch.equal(back.pop("gen"), state["gen"])
    assert torch.equal(back["int_keys"][1].pop("deep"), torch.arange(3))
    expected = dict(state, int_keys={0: "a", 1: {}})
    expected.pop("gen")
    assert back == expected


def test_a_single_marker_key_of_a_user_dict_is_not_mistaken_for_a_marker():
    state = {"__tensor__": "t0"}
    tree, tensors = _files.encode(state)
    assert _files.decode(tree, tensors) == state


@pytest.mark.parametrize(
    "value,path",
    [
        pytest.param({"a": {"b": object()}}, "/a/b", id="object"),
        pytest.param({"a": [1, {2.5: 1}]}, "/a/1", id="float-key"),
        pytest.param({"x": float("nan")}, "/x", id="nan"),
        pytest.param({"s": {1, 2}}, "/s", id="set"),
    ],
)
def test_a_value_that_cannot_be_stored_fails_at_save_time_with_its_path(tmp_path, value, path):
    with pytest.raises(StateSerializationError, match=f"'{path}'") as info:
        _files.write_loader_state(tmp_path, 0, 0, value)
    assert info.value.path == path
    assert not list(tmp_path.rglob("*.json"))


def test_written_state_reads_back(tmp_path):
    state = {"epoch": 2, "rng": torch.Generator().manual_seed(1).get_state()}
    _files.write_loader_state(tmp_path, 1, 3, state)
    back = _files.read_loader_state(tmp_path, 1, 3)
    assert back["epoch"] == 2 and torch.equal(back["rng"], state["rng"])


def test_a_missing_rank_state_is_an_error_naming_the_file(tmp_path):
    with pytest.raises(CheckpointError, match=r"loader_0\.rank_1\.json is missing"):
        _files.read_loader_state(tmp_path, 0, 1)


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(b'{"epoch": 1', id="truncated"),
        pytest.param(b"\x80\x04\x95 not json", id="binary"),
        pytest.param(pickle.dumps({"epoch": 1}), id="pickle"),
        pytest.param(b'{"x": NaN}', id="nan-constant"),
    ],
)
def test_a_damaged_or_foreign_state_file_is_refused_without_unpickling(tmp_path, payload):
    path = _files.state_file(tmp_path, 0, 0)
    path.parent.mkdir(parents=True)
    path.write_bytes(payload)
    with pytest.raises(CheckpointError, match="not a valid JSON loader state"):
        _files.read_loader_state(tmp_path, 0, 0)


def test_a_pickle_in_place_of_the_tensor_file_is_refused(tmp_path):
    _files.write_loader_state(tmp_path, 0, 0, {"t": torch.zeros(2)})
    _files.state_file(tmp_path, 0, 0, "safetensors").write_bytes(pickle.dumps(torch.zeros(2)))
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        _files.read_loader_state(tmp_path, 0, 0)


def _checkpoint(root: Path, number: int, complete: bool = True) -> Path:
    path = root / f"checkpoint_{number}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"weights")
    _files.write_loader_state(path, 0, 0, {"epoch": number})
    if complete:
        _files.write_manifest(path, world_size=1, num_loaders=1)
    return path


def test_the_latest_complete_checkpoint_is_found_and_incomplete_ones_are_skipped(tmp_path):
    _checkpoint(tmp_path, 1)
    newest_complete = _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 10, complete=False)
    (tmp_path / "not_a_checkpoint").mkdir()
    assert latest_checkpoint(tmp_path) == newest_complete
    assert latest_checkpoint(tmp_path / "missing") is None


@pytest.mark.parametrize(
    "damage,match",
    [
        pytest.param(lambda p: (p / "model.safetensors").write_bytes(b"w"), "truncated or was replaced", id="size"),
        pytest.param(lambda p: (p / "model.safetensors").unlink(), "missing", id="missing-file"),
        pytest.param(
            lambda p: _files.state_file(p, 0, 0).write_text('{"epoch": 9}'), "does not match the hash", id="edited"
        ),
        pytest.param(lambda p: (p / _files.SUBDIR / _files.MANIFEST).write_text("{"), "damaged", id="manifest"),
        pytest.param(lambda p: (p / _files.SUBDIR / _files.MANIFEST).unlink(), "incomplete", id="no-manifest"),
    ],
)
def test_a_damaged_checkpoint_is_not_complete(tmp_path, damage, match):
    path = _checkpoint(tmp_path, 1)
    damage(path)
    with pytest.raises(CheckpointError, match=match):
        _files.read_manifest(path)
    assert latest_checkpoint(tmp_path) is None


def test_a_checkpoints_listing_is_every_file_below_it_but_hidden_ones_links_to_folders_and_the_manifest(tmp_path):
    """What a manifest lists: the files of every folder below the checkpoint (hidden folders too: only a hidden
    file's own name leaves it out), a link to a file as a file, a link to a folder not entered, as
    ``Path.rglob`` finds them."""
    from accelerate_stateful.checkpoint import _integrity

    root = tmp_path / "ckpt"
    for rel in ("model.safetensors", "a/b/c.bin", ".hidden_dir/kept.bin", "accelerate_stateful/loader_0.json",
                "accelerate_stateful/MANIFEST.json", ".tmp-save", "a/.partial"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "far.bin").write_bytes(b"y")
    (root / "linked_folder").symlink_to(tmp_path / "outside", target_is_directory=True)
    (root / "linked_file.bin").symlink_to(root / "model.safetensors")
    (root / "broken_link").symlink_to(tmp_path / "missing")
    by_rglob = sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                      if not p.name.startswith(".") and p.is_file() and p.name != "MANIFEST.json")
    assert _integrity.listing(root) == by_rglob == [
        ".hidden_dir/kept.bin", "a/b/c.bin", "accelerate_stateful/loader_0.json", "linked_file.bin",
        "model.safetensors"]
