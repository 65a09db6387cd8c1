"""``Filtered``: a filter stage that resumes exactly and elastically, alone, in a mixture, under a packer, and
wrapping the other sources; its per-source accounting of kept and dropped items; refusals in the user's terms.

Source items are ints (or documents whose first token is the int); ``keep`` drops runs of four consecutive
items (``i % 7`` in 2..5), and the last items of the 40 are such a run, so a source ends right after dropped
items. Every cut of the direct runs is a kill point: right after a run of dropped items, and at the end too.
"""

from __future__ import annotations

import copy
import itertools
import json
import pickle

import datasets
import pytest
import torch
from torch.utils.data import DataLoader

from accelerate_stateful import DistContext, Filtered, IterableShardDataLoader
from accelerate_stateful.errors import CheckpointError, UnsupportedConfigError
from accelerate_stateful.sources import Mixture, Packed, Shuffled
from accelerate_stateful.sources._global import agree_states

from harness import run_loop, through_files

N = 40


def keep(item) -> bool:
    value = item["input_ids"][0] if isinstance(item, dict) else item
    return value % 7 not in (2, 3, 4, 5)


class Logged(list):
    """A map-style source that records which indices were read."""

    reads: list = []

    def __getitem__(self, index):
        Logged.reads.append(index)
        return super().__getitem__(index)


def docs(base: int) -> list[dict]:
    return [{"input_ids": [base + i] + [0] * (i % 5)} for i in range(N)]


CONFIGS = {
    "top": lambda: Filtered(list(range(N)), keep),
    "in-mixture": lambda: Mixture({"a": Filtered(list(range(N)), keep), "b": list(range(1000, 1000 + N))},
                                  {"a": 2, "b": 1}, seed=3),
    "under-packed": lambda: Packed(Filtered(docs(0), keep), seq_len=4, last="pad"),
    "over-mixture": lambda: Filtered(Mixture({"a": list(range(N)), "b": list(range(1000, 1000 + N))},
                                             {"a": 1, "b": 1}, seed=5), keep),
    "over-shuffled": lambda: Filtered(Shuffled(list(range(N)), 6, seed=2), keep),
    "under-shuffled": lambda: Shuffled(Filtered(list(range(N)), keep), 5, seed=1),
}


def plain(item):
    return item["input_ids"].tolist() if isinstance(item, dict) else int(item)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_resume_at_every_point_continues_the_uninterrupted_sequence(config):
    whole = [plain(x) for x in CONFIGS[config]()]
    assert whole and len(whole) < N * (2 if config == "in-mixture" else 1)  # something was dropped
    for cut in range(len(whole) + 1):  # after every run of dropped items, and at the source's end
        run = CONFIGS[config]()
        head = [plain(x) for x in itertools.islice(iter(run), cut)]
        resumed = CONFIGS[config]()
        resumed.load_state_dict(json.loads(json.dumps(run.state_dict())))
        assert head + [plain(x) for x in resumed] == whole, f"cut {cut}"


def test_the_kept_items_are_the_sources_in_order_and_no_item_is_read_twice_across_a_resume():
    whole = [i for i in range(N) if keep(i)]
    assert list(Filtered(list(range(N)), keep)) == whole
    for cut in (0, 2, 3, len(whole) - 1, len(whole)):  # 2 is right after the run 2..5 was dropped
        Logged.reads = []
        run = Filtered(Logged(range(N)), keep)
        head = list(itertools.islice(iter(run), cut))
        resumed = Filtered(Logged(range(N)), keep)
        resumed.load_state_dict(run.state_dict())
        assert head + list(resumed) == whole
        assert Logged.reads == list(range(N)), f"cut {cut}: every source item read once, in order"


def test_the_position_counts_kept_and_dropped_items_as_drawn():
    run = Filtered(list(range(N)), keep)
    items = iter(run)
    assert run.counts() == {"kept": 0, "dropped": 0}
    assert [next(items) for _ in range(3)] == [0, 1, 6]
    assert run.state_dict()["position"] == {"source": 7, "kept": 3, "dropped": 4}
    assert run.counts() == {"kept": 3, "dropped": 4} == run.counts(run.state_dict())
    rest = list(items)
    assert run.counts() == {"kept": 3 + len(rest), "dropped": N - 3 - len(rest)}


def test_a_skip_range_leaves_out_kept_items_by_their_index_while_the_counts_stay_what_was_drawn():
    whole = [i for i in range(N) if keep(i)]
    stream = Filtered(list(range(N)), keep)
    stream.load_state_dict({"index": 0, "position": None, "skip": [[1, 3]]})  # what loader.skip_samples puts there
    assert list(stream) == whole[:1] + whole[3:]
    assert stream.counts() == {"kept": len(whole), "dropped": N - len(whole)}


def test_a_mixture_reports_kept_and_dropped_next_to_its_per_source_counts():
    mix = CONFIGS["in-mixture"]()
    items = list(itertools.islice(iter(mix), 30))
    position = mix.state_dict()["position"]
    filtered = mix.sources["a"]
    counts = filtered.counts(position["sources"]["a"])
    assert counts["kept"] == position["drawn"]["a"] == mix.delivered()["a"] == sum(1 for i in items if i < 1000)
    assert counts["kept"] + counts["dropped"] == position["sources"]["a"]["source"]  # items read from the list
    assert counts["dropped"] == sum(1 for i in range(counts["kept"] + counts["dropped"]) if not keep(i))


def test_a_weight_change_reaches_a_mixture_under_a_filter_and_keeps_its_counts():
    def make(weights):
        return Filtered(Mixture({"a": list(range(N)), "b": list(range(1000, 1000 + N))}, weights, seed=5), keep)

    run = make({"a": 1, "b": 2})
    list(itertools.islice(iter(run), 6))
    saved = json.loads(json.dumps(run.state_dict()))
    agreed, lines = agree_states(make({"a": 1, "b": 1}), [saved])
    assert len(lines) == 1 and "{a: 1, b: 2} -> {a: 1, b: 1}" in lines[0]
    assert {key: agreed[0]["position"][key] for key in ("kept", "dropped")} == run.counts()


def by_id(row) -> bool:
    return keep(row["id"])


def hf_filter(before_5_2: bool):
    """``ds.filter(by_id)`` over Arrow data, as datasets 5.2 builds it or as older releases did (datasets#8359:
    the filter reads whole tables, and its own state skips the rest of the table it is reading)."""
    ds = datasets.Dataset.from_dict({"id": list(range(N))}).to_iterable_dataset(num_shards=2).filter(by_id)
    if before_5_2:
        formatted = ds._ex_iterable.ex_iterable
        assert type(formatted.ex_iterable).__name__ == "RebatchedArrowExamplesIterable"  # 5.2's fix, taken out
        formatted.ex_iterable = formatted.ex_iterable.ex_iterable
    return ds


@pytest.mark.parametrize("before_5_2", [False, True], ids=["datasets-5.2", "before-5.2"])
def test_a_datasets_filter_inside_a_mixture_resumes_at_every_point(before_5_2):
    def make():
        return Mixture({"h": hf_filter(before_5_2), "l": list(range(1000, 1000 + N))}, {"h": 1, "l": 1}, seed=1)

    whole = [x if isinstance(x, int) else x["id"] for x in make()]
    assert sorted(i for i in whole if i < 1000) == [i for i in range(N) if keep(i)]
    for cut in sorted({*range(0, len(whole), 3), len(whole)}):
        run = make()
        head = [x if isinstance(x, int) else x["id"] for x in itertools.islice(iter(run), cut)]
        resumed = make()
        resumed.load_state_dict(json.loads(json.dumps(run.state_dict())))
        assert head + [x if isinstance(x, int) else x["id"] for x in resumed] == whole, f"cut {cut}"


# ---------------------------------------------------------------- through the loader: workers and processes
EPOCHS, BATCH = 2, 3
LOADED = {"top": CONFIGS["top"], "in-mixture": CONFIGS["in-mixture"], "under-packed": CONFIGS["under-packed"]}


def ids(rows):
    """Collate: one id per item (a packed row's tokens hashed), so a batch can be compared as a tuple."""
    return {"id": torch.tensor([hash(tuple(plain(r))) & 0xFFFFFFF if isinstance(r, dict) else int(r)
                                for r in rows])}


def make(config, workers, world=1, rank=0):
    dl = DataLoader(LOADED[config](), batch_size=BATCH, num_workers=workers, collate_fn=ids)
    return IterableShardDataLoader.from_dataloader(dl, DistContext(rank, world))


def whole_epoch(config, epoch):
    stream = LOADED[config]()
    stream.set_epoch(epoch)
    return sorted(ids(list(stream))["id"].tolist())


@pytest.mark.parametrize("config,saved,now,where", [
    ("top", 2, 0, "mid"), ("in-mixture", 0, 2, "early"), ("under-packed", 2, 1, "last")])
def test_a_resume_on_another_worker_count_continues_the_epoch_and_loses_or_repeats_nothing(
        config, saved, now, where):
    first_run = run_loop(make(config, saved), EPOCHS)[0]
    length = sum(1 for s in first_run if s.epoch == 0)
    stop = {"early": 1, "mid": length // 2, "last": length}[where]
    head, state = run_loop(make(config, saved), EPOCHS, (stop, "in_loop"))
    resumed = make(config, now)
    resumed.load_state_dict(through_files(state))
    seen = head + run_loop(resumed, EPOCHS, taken=stop)[0]
    fresh = run_loop(make(config, now), EPOCHS)[0]
    assert seen == [s for s in first_run if s.epoch == 0] + [s for s in fresh if s.epoch > 0]
    for epoch in range(EPOCHS):
        assert sorted(i for s in seen if s.epoch == epoch for i in s.ids) == whole_epoch(config, epoch)


@pytest.mark.parametrize("config,world,new_world", [("top", 2, 3), ("in-mixture", 3, 2), ("under-packed", 1, 2)])
def test_simulated_ranks_resumed_on_another_number_of_processes_deliver_every_unconsumed_item_once(
        config, world, new_world):
    taken, states = [], []
    for rank in range(world):
        loader = make(config, 0, world, rank)
        batches = iter(loader)
        taken += [i for _ in range(2) for i in next(batches)["id"].tolist()]
        states.append(through_files(loader.state_dict(), rank))
        del batches
    rest = []
    for rank in range(new_world):
        loader = make(config, 0, new_world, rank)
        loader.load_state_dict(states[0])
        rest += [i for batch in loader for i in batch["id"].tolist()]
    epoch = whole_epoch(config, 0)
    assert len(taken) == len(set(taken)) and set(taken) <= set(epoch)
    fresh = [i for i in rest if i not in set(taken)]
    assert sorted(set(fresh)) == sorted(set(epoch) - set(taken))
    # besides the padding that completes each rank's last global batch, every item comes once
    assert len(rest) - len(set(fresh)) < BATCH * new_world


# ---------------------------------------------------------------- refusals
def fails_on_twelve(item):
    if item == 12:
        raise ValueError("no twelves")
    return True


def test_a_predicate_that_raises_names_the_items_index_and_the_source():
    run = Filtered(list(range(N)), fails_on_twelve)
    with pytest.raises(UnsupportedConfigError, match=r"fails_on_twelve .*raised ValueError: no twelves on item 12 "
                                                     r"of its source \(a list"):
        list(run)


def test_a_predicate_that_is_not_a_function_is_refused_with_the_fix():
    with pytest.raises(UnsupportedConfigError, match=r"predicate must be a function of an item"):
        Filtered(list(range(N)), "len > 3")


def test_a_lambda_predicate_is_refused_for_spawned_workers_with_the_fix_and_deep_copies_still():
    stream = Filtered(list(range(N)), lambda item: item % 2 == 0)
    assert list(copy.deepcopy(stream)) == list(range(0, N, 2))  # a copy in this process shares the function
    assert pickle.loads(pickle.dumps(Filtered(list(range(N)), keep))).predicate is keep
    with pytest.raises(UnsupportedConfigError, match=r"cannot be sent to DataLoader workers .*define it with def at "
                                                     r"the top level of a module"):
        pickle.dumps(stream)
    loader = DataLoader(stream, batch_size=2, num_workers=2, multiprocessing_context="spawn")
    with pytest.raises(UnsupportedConfigError, match=r"<lambda> of a Filtered cannot be sent to DataLoader workers"):
        next(iter(loader))


@pytest.mark.parametrize("position", [{"source": 3, "kept": -1, "dropped": 0}, {"source": 3, "kept": 1},
                                      {"source": 99, "kept": 1, "dropped": 0}])
def test_a_damaged_position_is_refused_at_the_load(position):
    with pytest.raises(CheckpointError, match=r"resume from a checkpoint written with this"):
        Filtered(list(range(N)), keep).load_state_dict({"index": 1, "position": position})
