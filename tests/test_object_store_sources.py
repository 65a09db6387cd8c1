"""Object-store streaming datasets (mosaicml-streaming, litdata) read by index in the loader's own order.

Shards are written with each library's own writer (``MDSWriter``, ``litdata.optimize``) and read from a local
directory or, for mosaicml-streaming, from a remote directory copied into a local cache by the library itself.
Nothing is mocked. Sample ``i`` of the mosaicml-streaming data has id ``i``; of the litdata data, ``1000 + i``;
a sample's tokens are ``[10 * id, 10 * id + 1, ...]`` (1 to 3 of them), so a packed row names its documents.
"""

from __future__ import annotations

import itertools
import multiprocessing

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from accelerate_stateful import (
    DistContext, Indexed, IterableShardDataLoader, Mixture, Packed, ShardDataLoader, Shuffled,
)
from accelerate_stateful.errors import UnsupportedConfigError

from harness import check_resumes, run_loop, save_points, through_files

streaming = pytest.importorskip("streaming")
litdata = pytest.importorskip("litdata")

N, BATCH, EPOCHS = 24, 2, 2


def tokens(sample_id: int) -> list:
    return [10 * sample_id + j for j in range(1 + sample_id % 3)]


def _lit_docs(start: int):
    for i in range(start, start + N // 2):
        yield {"id": 1000 + i, "input_ids": np.array(tokens(1000 + i), dtype=np.int64)}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """One folder of MDS shards and one of litdata chunks, each of N samples in several files."""
    root = tmp_path_factory.mktemp("shards")
    with streaming.MDSWriter(out=str(root / "mds"), columns={"id": "int", "input_ids": "ndarray:int64"},
                             size_limit=1 << 8) as writer:
        for i in range(N):
            writer.write({"id": i, "input_ids": np.array(tokens(i), dtype=np.int64)})
    # optimize() sets the process's multiprocessing start method (spawn unless told): put back what it was,
    # or every later DataLoader of this test process would start its workers by spawn.
    method = multiprocessing.get_start_method(allow_none=True)
    litdata.optimize(fn=_lit_docs, inputs=[0, N // 2], output_dir=str(root / "lit"), chunk_bytes=256,
                     num_workers=1, mode="overwrite", start_method="fork")
    multiprocessing.set_start_method(method, force=True)
    return root


def mosaic(shards, **kwargs):
    return streaming.StreamingDataset(local=str(shards / "mds"), batch_size=BATCH, **kwargs)


def lit(shards, **kwargs):
    return litdata.StreamingDataset(str(shards / "lit"), **kwargs)


LIBRARIES = {"mosaicml-streaming": (mosaic, 0), "litdata": (lit, 1000)}


def ids(steps, epoch=None):
    return [i for s in steps if epoch is None or s.epoch == epoch for i in s.ids]


@pytest.mark.parametrize("library", list(LIBRARIES))
def test_a_streaming_dataset_is_read_by_global_index_with_its_own_number_of_samples(shards, library):
    build, base = LIBRARIES[library]
    data = Indexed(build(shards))
    assert len(data) == N and [data[i]["id"] for i in range(N)] == list(range(base, base + N))


def test_a_mosaic_remote_is_downloaded_into_its_local_cache_by_the_library(shards, tmp_path):
    data = Indexed(streaming.StreamingDataset(remote=str(shards / "mds"), local=str(tmp_path / "cache"),
                                              batch_size=BATCH))
    assert [data[i]["id"] for i in (23, 0, 11)] == [23, 0, 11]
    assert (tmp_path / "cache" / "index.json").exists()


def ids_only(samples):
    """Collate: the samples' ids (their token lists differ in length)."""
    return {"id": torch.tensor([int(s["id"]) for s in samples])}


def shard_loader(shards, library, workers=0, world=1, rank=0):
    build, _ = LIBRARIES[library]
    dl = DataLoader(Indexed(build(shards)), batch_size=BATCH, shuffle=True, num_workers=workers,
                    collate_fn=ids_only, generator=torch.Generator().manual_seed(5))
    return ShardDataLoader.from_dataloader(dl, DistContext(rank, world), even_batches=False)


@pytest.mark.parametrize("library", list(LIBRARIES))
def test_a_prepared_loader_resumes_exactly_at_every_save_point_without_workers(shards, library):
    make = lambda: shard_loader(shards, library)  # noqa: E731
    reference, _ = run_loop(make(), EPOCHS)
    points = save_points(reference)
    check_resumes(make, EPOCHS, [[p] for p in points] + [points[1::4]], reference)
    assert sorted(ids(reference, 0)) == list(range(LIBRARIES[library][1], LIBRARIES[library][1] + N))


@pytest.mark.parametrize("library", list(LIBRARIES))
def test_a_prepared_loader_with_two_workers_resumes_exactly(shards, library):
    make = lambda: shard_loader(shards, library, workers=2)  # noqa: E731
    reference, _ = run_loop(make(), EPOCHS)
    assert reference == run_loop(shard_loader(shards, library), EPOCHS)[0]  # workers change nothing
    check_resumes(make, EPOCHS, [[(5, "in_loop"), (N // BATCH + 1, "in_loop")]], reference)


@pytest.mark.parametrize("library", list(LIBRARIES))
def test_a_run_resumed_on_one_then_two_then_three_ranks_delivers_every_sample_once(shards, library):
    """Each resume loads rank 0's state (the global position); a change of workers goes with the second."""
    consumed, state = [], None
    for world, workers, steps in [(1, 0, 3), (2, 2, 2), (3, 0, None)]:
        loaders = [shard_loader(shards, library, workers, world, rank) for rank in range(world)]
        for loader in loaders:
            if state is not None:
                loader.load_state_dict(through_files(state, loader.ctx.rank))
            taken, _ = run_loop(loader, 1 if steps is None else EPOCHS, None if steps is None else (steps, "in_loop"))
            consumed += ids(taken)
        state = loaders[0].state_dict()
    base = LIBRARIES[library][1]
    assert sorted(consumed) == list(range(base, base + N))
    fresh = [ids(run_loop(shard_loader(shards, library, 0, 3, r), EPOCHS)[0], 1) for r in range(3)]
    later = [ids(run_loop(loader, EPOCHS)[0], 1) for loader in loaders]  # epoch 1 on the resumed ranks
    assert later == fresh


def test_a_bare_streaming_dataset_prepared_by_the_accelerator_is_read_by_index_on_each_rank(shards):
    from accelerate.utils import DataLoaderConfiguration

    from accelerate_stateful import Accelerator

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    dl = accelerator.prepare(DataLoader(mosaic(shards), batch_size=BATCH, collate_fn=ids_only))
    assert isinstance(dl, ShardDataLoader) and isinstance(dl.dataset, Indexed)
    assert [i for batch in dl for i in batch["id"].tolist()] == list(range(N))


# ------------------------------------------------------------------ as children of the composable sources
def rows_as_ids(rows):
    """Collate: one id per packed row (its tokens), so a batch compares as a tuple."""
    return {"id": torch.tensor([hash(tuple(r["input_ids"].tolist())) & 0xFFFFFFF for r in rows])}


def pipeline(shards):
    """Both libraries' bare datasets mixed, shuffled and packed."""
    mixed = Mixture({"mds": mosaic(shards), "lit": lit(shards)}, {"mds": 1.0, "lit": 1.0}, seed=3)
    return Packed(Shuffled(mixed, buffer_size=5, seed=1), seq_len=4, last="pad")


def stream_loader(shards, workers, world=1, rank=0):
    dl = DataLoader(pipeline(shards), batch_size=BATCH, num_workers=workers, collate_fn=rows_as_ids)
    return IterableShardDataLoader.from_dataloader(dl, DistContext(rank, world))


def test_mixed_shuffled_and_packed_they_resume_on_other_worker_counts_as_the_uninterrupted_run(shards):
    reference = run_loop(stream_loader(shards, 0), EPOCHS)[0]
    seen, state = [], None
    for workers, stop in [(0, 3), (2, 7), (0, None)]:
        loader = stream_loader(shards, workers)
        if state is not None:
            loader.load_state_dict(through_files(state))
        steps, state = run_loop(loader, EPOCHS, None if stop is None else (stop, "in_loop"), taken=len(seen))
        seen += steps
    assert seen == reference
    whole = sorted(rows_as_ids(list(pipeline(shards)))["id"].tolist())
    assert sorted(ids(reference, 0)) == whole


def test_mixed_shuffled_and_packed_they_resume_on_one_then_two_then_three_ranks(shards):
    """Every rank reads the global sequence and slices its global batches; new ranks go on from rank 0's state."""
    whole = set(rows_as_ids(list(pipeline(shards)))["id"].tolist())
    taken, state = [], None
    for world, workers, steps in [(1, 0, 2), (2, 2, 1)]:
        states = []
        for rank in range(world):
            loader = stream_loader(shards, workers, world, rank)
            if state is not None:
                loader.load_state_dict(through_files(state, rank))
            batches = iter(loader)  # live while the state is taken, as in a training loop
            taken += [i for batch in itertools.islice(batches, steps) for i in batch["id"].tolist()]
            states.append(loader.state_dict())
            del batches
        state = states[0]
    rest = []
    for rank in range(3):
        loader = stream_loader(shards, 0, 3, rank)
        loader.load_state_dict(through_files(state, rank))
        rest += [i for batch in loader for i in batch["id"].tolist()]
    assert len(taken) == len(set(taken)) and set(taken) <= whole
    assert set(rest) - set(taken) == whole - set(taken) and not set(rest) & set(taken) - whole
    assert len(rest) - len(whole - set(taken)) < BATCH * 3  # only the padding that completes the last step


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("library", list(LIBRARIES))
def test_a_dataset_with_its_own_shuffle_on_is_refused_naming_the_setting_and_the_fix(shards, library):
    build, _ = LIBRARIES[library]
    with pytest.raises(UnsupportedConfigError, match=rf"{library} StreamingDataset was built with shuffle=True.*"
                                                     r"DataLoader\(Indexed\(dataset\), shuffle=True\)"):
        Indexed(build(shards, shuffle=True))
    with pytest.raises(UnsupportedConfigError, match=r"shuffle=True, which shuffles only its own iteration"):
        Mixture({"a": build(shards, shuffle=True)}, {"a": 1.0})


def test_a_mosaic_epoch_that_resamples_its_streams_is_refused(shards):
    with pytest.raises(UnsupportedConfigError, match=r"resamples its epoch \(48 samples drawn from 24: epoch_size"):
        Indexed(mosaic(shards, epoch_size=2 * N))


def test_indexed_refuses_a_dataset_of_another_library():
    with pytest.raises(UnsupportedConfigError, match=r"not a list; give any other map-style dataset"):
        Indexed([1, 2, 3])
