"""Loader positions through torch.distributed.checkpoint: fixed structure, exact round trips, whole-or-refused loads."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.utils.data import DataLoader

from accelerate_stateful import (
    CheckpointError,
    DistContext,
    IterableShardDataLoader,
    LifecycleError,
    ShardDataLoader,
    SkipDataLoader,
    StateMismatchError,
    StateSerializationError,
    UnsupportedConfigError,
)
from accelerate_stateful.checkpoint.dcp import _HEADER, _MAGIC, LoaderCheckpoint

from harness import assert_same_stream, run_loop, save_points
from streams import CountingStream
import mp_harness

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

EPOCHS = 2
SCENARIOS = Path(__file__).with_name("dcp_scenarios.py")
REPO = SCENARIOS.parent.parent


def shard(rank=0, world=1, batch_size=3, n=23):
    dl = DataLoader(list(range(n)), batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(0))
    return ShardDataLoader.from_dataloader(dl, DistContext(rank, world))


def stream(batch_size=2, n=11):
    return IterableShardDataLoader.from_dataloader(DataLoader(CountingStream(n), batch_size=batch_size),
                                                   DistContext(0, 1))


def structure(state):
    return {rank: {name: (t.dtype, tuple(t.shape)) for name, t in buffers.items()} for rank, buffers in state.items()}


def save(folder, loaders, **kw):
    dcp.save({"dataloader": LoaderCheckpoint(loaders, **kw)}, checkpoint_id=str(folder))


def load(folder, loaders, planner=None, **kw):
    dcp.load({"dataloader": LoaderCheckpoint(loaders, **kw)}, checkpoint_id=str(folder), planner=planner)


def buffer_of(loader, **kw):
    """The buffer a saver would write for ``loader`` (another object than the one that loads it)."""
    (buffers,) = LoaderCheckpoint(loader, **kw).state_dict().values()
    return buffers["loader_0"]


def raw_buffer(payload: bytes, capacity=64 * 1024):
    data = _HEADER.pack(_MAGIC, os.urandom(8), len(payload), 0) + payload
    buffer = torch.zeros(capacity, dtype=torch.uint8)
    buffer[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buffer


# --------------------------------------------------------------------------- structure
def test_state_dict_keeps_its_keys_dtypes_and_shapes_while_the_loader_state_changes_shape():
    loader = stream()
    ckpt = LoaderCheckpoint(loader)
    not_started = loader.state_dict()
    shapes = [structure(ckpt.state_dict())]
    it = iter(loader)
    next(it)
    iterating = loader.state_dict()
    shapes.append(structure(ckpt.state_dict()))
    for _ in it:
        pass
    shapes.append(structure(ckpt.state_dict()))
    assert not_started["stream"]["snapshots"] == [None] and iterating["stream"]["snapshots"][0]["dataset"] == {"pos": 2}
    assert shapes == [{"rank_0": {"loader_0": (torch.uint8, (64 * 1024,))}}] * 3


def test_each_rank_keys_its_buffers_by_its_own_rank():
    assert list(LoaderCheckpoint(shard(rank=1, world=2)).state_dict()) == ["rank_1"]
    assert list(LoaderCheckpoint(shard(rank=1, world=4), rank=0).state_dict()) == ["rank_0"]


# --------------------------------------------------------------------------- round trips
def _points():
    reference, _ = run_loop(shard(), EPOCHS)
    return [pytest.param(point, id=f"{point[0]}-{point[1]}") for point in save_points(reference)]


@pytest.mark.parametrize("point", _points())
def test_a_position_round_trips_through_dcp_save_and_load(tmp_path, point):
    reference, _ = run_loop(shard(), EPOCHS)
    saver = shard()
    before, state = run_loop(saver, EPOCHS, point)
    assert saver.state_dict() == state  # the iterator is gone; the position stays where the loop stopped
    save(tmp_path, saver)

    resumed = shard()
    load(tmp_path, resumed)
    after, _ = run_loop(resumed, EPOCHS, taken=len(before))
    assert_same_stream(reference, before + after, [point])


def test_two_loaders_at_unrelated_positions_round_trip_together_skip_view_included(tmp_path):
    main, aux = shard(), stream()
    skipped = SkipDataLoader(main, 2)
    main_ref, aux_ref = [b.tolist() for b in shard()], [b.tolist() for b in stream()]
    it, aux_it = iter(skipped), iter(aux)
    seen = [next(it).tolist()]
    aux_seen = [next(aux_it).tolist() for _ in range(3)]
    save(tmp_path, [skipped, aux])

    main2, aux2 = shard(), stream()
    load(tmp_path, [main2, aux2])
    assert main_ref[2:] == seen + [b.tolist() for b in main2]
    assert aux_ref == aux_seen + [b.tolist() for b in aux2]


# --------------------------------------------------------------------------- refusals
def test_a_checkpoint_for_another_dataset_is_refused_and_changes_nothing(tmp_path):
    save(tmp_path, shard())
    loader = shard(n=24)
    before = loader.state_dict()
    with pytest.raises(StateMismatchError, match=r"len\(dataset\): saved 23, current 24"):
        load(tmp_path, loader)
    assert loader.state_dict() == before


def test_a_shard_loader_resumes_at_another_batch_size(tmp_path):
    first = shard()
    it = iter(first)
    taken = [next(it).tolist() for _ in range(2)]
    save(tmp_path, first)
    del it
    loader = shard(batch_size=4)
    load(tmp_path, loader)
    rest = [b.tolist() for b in loader]
    assert [len(b) for b in rest] == [4, 4, 4, 4, 1]
    assert sorted(i for b in taken + rest for i in b) == list(range(23))


def test_a_checkpoint_with_more_loaders_is_refused_not_silently_cut(tmp_path):
    save(tmp_path, [shard(), shard()])
    with pytest.raises(StateMismatchError, match="num_loaders: saved 2, current 1"):
        load(tmp_path, shard())


def test_a_checkpoint_with_fewer_loaders_is_refused_by_dcp_naming_the_missing_key(tmp_path):
    save(tmp_path, shard())
    with pytest.raises(CheckpointException) as info:
        load(tmp_path, [shard(), shard()])
    assert "Missing key in checkpoint state_dict: dataloader.rank_0.loader_1" in str(info.value.failures[0])


def test_a_checkpoint_with_another_capacity_is_refused_by_dcp(tmp_path):
    save(tmp_path, shard())
    with pytest.raises(CheckpointException) as info:
        load(tmp_path, shard(), capacity=4096)
    assert "Size mismatch" in str(info.value.failures[0])


def test_a_partial_load_that_skips_the_loader_key_is_refused(tmp_path):
    dcp.save({"model": {"weight": torch.zeros(2)}}, checkpoint_id=str(tmp_path))
    loader = shard()
    with pytest.raises(CheckpointError, match=r"'dataloader\.rank_0\.loader_0' was not filled by the load"):
        load(tmp_path, loader, planner=DefaultLoadPlanner(allow_partial_load=True))
    assert loader.state_dict() == shard().state_dict()


def test_a_state_too_large_for_the_capacity_fails_at_save_time_with_the_capacity_to_pass(tmp_path):
    with pytest.raises(StateSerializationError, match=r"more than capacity=128; pass .*capacity=\d+") as info:
        save(tmp_path, shard(), capacity=128)
    assert info.value.path == "rank_0/loader_0"


@pytest.mark.parametrize(
    "make_buffer,error,match",
    [
        pytest.param(lambda: buffer_of(shard(rank=1, world=2)), StateMismatchError, "rank: saved 1, current 0",
                     id="another-rank"),
        pytest.param(lambda: buffer_of(shard(world=1)), StateMismatchError, "world_size: saved 1, current 2",
                     id="another-world-size"),
        pytest.param(lambda: torch.zeros(64 * 1024, dtype=torch.uint8), CheckpointError,
                     "not a loader buffer written by LoaderCheckpoint", id="zeros"),
        pytest.param(lambda: raw_buffer(b'{"state": {"epoch": 1'), CheckpointError,
                     "does not hold a valid loader state", id="truncated-json"),
        pytest.param(lambda: raw_buffer(json.dumps({"envelope_version": 9, "state": {}}).encode()), CheckpointError,
                     "envelope_version=9, .*newer release.*reads envelope_version 1: upgrade", id="newer-envelope"),
        pytest.param(lambda: raw_buffer(json.dumps({"envelope_version": 0, "state": {}}).encode()), CheckpointError,
                     "envelope_version=0, .*reads envelope_version 1: upgrade", id="unknown-envelope"),
        pytest.param(lambda: torch.zeros(1024, dtype=torch.uint8), StateMismatchError,
                     r"buffer: saved 'torch.uint8 tensor of shape \(1024,\)'", id="other-shape"),
        pytest.param(lambda: torch.zeros(64 * 1024, dtype=torch.int32), StateMismatchError, "torch.int32",
                     id="other-dtype"),
        pytest.param(lambda: 3, StateMismatchError, "buffer: saved 'int'", id="not-a-tensor"),
    ],
)
def test_a_foreign_or_damaged_buffer_is_refused(make_buffer, error, match):
    loader = shard(rank=0, world=2)
    before = loader.state_dict()
    with pytest.raises(error, match=match):
        LoaderCheckpoint(loader).load_state_dict({"rank_0": {"loader_0": make_buffer()}})
    assert loader.state_dict() == before


@pytest.mark.parametrize(
    "state",
    [
        pytest.param({}, id="empty"),
        pytest.param({"rank_1": {"loader_0": None}}, id="another-rank-key"),
        pytest.param({"rank_0": {"loader_0": None, "loader_1": None}}, id="extra-loader"),
        pytest.param({"rank_0": {}}, id="no-loader"),
        pytest.param({"rank_0": torch.zeros(2)}, id="flat"),
    ],
)
def test_a_dict_of_another_structure_is_refused_listing_both_structures(state):
    with pytest.raises(StateMismatchError, match=r"structure: saved .*, current \{'rank_0': \['loader_0'\]\}"):
        LoaderCheckpoint(shard()).load_state_dict(state)


def test_a_hand_edited_position_in_a_valid_buffer_is_refused():
    saver = LoaderCheckpoint(shard())
    envelope = json.loads(_payload(saver.state_dict()["rank_0"]["loader_0"]))
    envelope["state"]["samples_consumed"] = 5
    with pytest.raises(UnsupportedConfigError, match="inconsistent position"):
        LoaderCheckpoint(shard()).load_state_dict({"rank_0": {"loader_0": raw_buffer(json.dumps(envelope).encode())}})


def _payload(buffer) -> str:
    raw = buffer.numpy().tobytes()
    _, _, text_len, _ = _HEADER.unpack_from(raw)
    return raw[_HEADER.size:_HEADER.size + text_len].decode()


class _Marker:
    """Unpickling this creates ``path``: proof that something was unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_a_pickle_in_the_buffer_is_refused_without_being_unpickled(tmp_path):
    marker = tmp_path / "unpickled"
    with pytest.raises(CheckpointError, match="does not hold a valid loader state"):
        LoaderCheckpoint(shard()).load_state_dict({"rank_0": {"loader_0": raw_buffer(pickle.dumps(_Marker(marker)))}})
    assert not marker.exists()


def test_a_refused_second_loader_leaves_the_first_unloaded():
    first, second = shard(), shard(n=24)
    saved = LoaderCheckpoint([_advanced(shard()), _advanced(shard())]).state_dict()
    with pytest.raises(StateMismatchError, match="loader_1"):
        LoaderCheckpoint([first, second]).load_state_dict(saved)
    assert first.state_dict() == shard().state_dict()


def test_a_live_iterator_on_any_loader_refuses_the_load_before_any_loader_changes():
    first, second = shard(), shard()
    saved = LoaderCheckpoint([_advanced(shard()), _advanced(shard())]).state_dict()
    it = iter(second)
    next(it)
    with pytest.raises(LifecycleError, match=r"LoaderCheckpoint.load_state_dict\(\) called while an iterator over a prepared loader is live \(rank 0: loader\(s\) \[1\]\)"):
        LoaderCheckpoint([first, second]).load_state_dict(saved)
    assert first.state_dict() == shard().state_dict()


def _advanced(loader, batches=2):
    it = iter(loader)
    for _ in range(batches):
        next(it)
    return loader


def test_something_that_is_not_a_prepared_loader_is_refused_at_construction():
    with pytest.raises(TypeError, match="loader 0 is a DataLoader"):
        LoaderCheckpoint(DataLoader(list(range(4))))


# --------------------------------------------------------------------------- two real processes
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_two_ranks_resume_exactly_through_dcp_save_and_load(tmp_path):
    done = mp_harness.launch(mp_harness.torchrun_command(SCENARIOS, [tmp_path]), tmp_path / "launch", timeout_s=150,
                             collective_timeout_s=60, watch=[tmp_path])
    print(f"torchrun, 2 ranks: {done.seconds:.1f} s")
    results = [json.loads(p.read_text()) for p in (tmp_path / f"rank{r}.json" for r in range(2)) if p.exists()]
    failures = [f for r in results for f in r["failures"]]
    assert done.ok and len(results) == 2 and not failures, "\n".join(failures) + "\n" + done.report()
    assert [r["round_trips"] for r in results] == [6, 6]
