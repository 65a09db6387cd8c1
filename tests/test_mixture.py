"""``Mixture`` read directly and through plain torch ``DataLoader``s: pure draws, exact resumes, weight changes,
per-source accounting, exhaustion policies, Hugging Face sources, and refusals in the user's terms.

Every source yields ``base + i`` for its ``i``-th item (``a``: 0.., ``b``: 1000.., ``c``: 2000..), so the
source and the index within it can be read off each delivered item.
"""

from __future__ import annotations

import itertools
import json
import logging
import random

import pytest
from torch.utils.data import DataLoader, IterableDataset

from accelerate_stateful.errors import CheckpointError, UnsupportedConfigError
from accelerate_stateful.sources._mixture_draw import Table, draw_key, uniform
from accelerate_stateful.sources.mixture import Mixture

BASES = {"a": 0, "b": 1000, "c": 2000}


class Counter(IterableDataset):
    """A stateful iterable: ``base, base + 1, ...`` (``n`` items), resumable from ``{"pos": i}``."""

    def __init__(self, base: int, n: int) -> None:
        self.base, self.n, self.pos = base, n, 0

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]

    def __iter__(self):
        while self.pos < self.n:
            self.pos += 1
            yield self.base + self.pos - 1


def sources(sizes=(40, 30, 60)) -> dict:
    a, b, c = sizes
    return {"a": list(range(a)), "b": Counter(1000, b), "c": [2000 + i for i in range(c)]}


def mixture(weights=None, seed=5, sizes=(40, 30, 60), **kwargs) -> Mixture:
    return Mixture(sources(sizes), weights or {"a": 1, "b": 1, "c": 2}, seed=seed, **kwargs)


def source_of(item: int) -> str:
    return "a" if item < 1000 else "b" if item < 2000 else "c"


def assert_each_source_read_in_order(items, sizes=(40, 30, 60)):
    """Per source, the items delivered are the first ones of its order, none lost or repeated."""
    for (name, base), size in zip(BASES.items(), sizes):
        got = sorted(i for i in items if source_of(i) == name)
        assert got == list(range(base, base + len(got))), f"source {name}: {got}"
        assert len(got) <= size


def direct_run(make, cuts, weights_at=None):
    """Iterate ``make()``, save after each count of items in ``cuts``, load into a fresh ``make()``, go on.

    ``weights_at``: ``{cut: weights}`` given to the mixture resumed at that cut and to the later ones.
    """
    items, state, prev, wanted = [], None, None, None
    for cut in list(cuts) + [None]:
        mix = make()
        wanted = (weights_at or {}).get(prev, wanted)
        if wanted is not None:
            mix.set_weights(wanted)
        if state is not None:
            mix.load_state_dict(json.loads(json.dumps(state)))
        stream = iter(mix)
        items += list(itertools.islice(stream, None if cut is None else cut - len(items)))
        state, prev = mix.state_dict(), cut
    return items, mix


CONFIGS = [(seed, weights) for seed, weights in
           [(0, {"a": 1, "b": 1, "c": 1}), (1, {"a": 0.2, "b": 0.5, "c": 0.3}), (7, {"a": 3, "b": 0, "c": 1}),
            (11, {"a": 1, "b": 5, "c": 2}), (2**40 + 3, {"a": 1e-3, "b": 1, "c": 1})]]


@pytest.mark.parametrize("seed,weights", CONFIGS)
def test_a_resume_at_any_point_continues_the_uninterrupted_sequence(seed, weights):
    whole = list(mixture(weights, seed))
    cuts = sorted(random.Random(seed).sample(range(1, len(whole) + 1), 4))
    items, _ = direct_run(lambda: mixture(weights, seed), cuts)
    assert items == whole
    assert_each_source_read_in_order(whole)
    assert "b" not in {source_of(i) for i in whole} or weights["b"] > 0


def test_the_source_of_a_sample_is_a_pure_function_of_seed_epoch_index_and_weights():
    table = Table({"a": 1, "b": 1, "c": 2})
    key = draw_key(5, 0)
    picks = [table.pick(uniform(key, k)) for k in range(50)]
    assert [source_of(i) for i in mixture()][:50] == picks
    assert Table({"c": 2, "a": 1, "b": 1}).pick(uniform(key, 3)) == picks[3], "the mapping's order does not matter"
    other_epoch = mixture()
    other_epoch.set_epoch(1)
    assert [source_of(i) for i in other_epoch][:50] != picks
    assert [source_of(i) for i in mixture(seed=6)][:50] != picks


def test_realized_proportions_stay_within_four_standard_deviations_of_the_weights():
    weights = {"a": 0.5, "b": 0.3, "c": 0.2}
    table, key, n = Table(weights), draw_key(3, 0), 20_000
    counts = {name: 0 for name in weights}
    for k in range(n):
        counts[table.pick(uniform(key, k))] += 1
    for name, p in weights.items():
        assert abs(counts[name] / n - p) < 4 * (p * (1 - p) / n) ** 0.5, counts


@pytest.mark.parametrize("workers", [0, 1, 2, 3])
def test_torch_dataloader_workers_each_deliver_their_share_of_the_one_sequence(workers):
    whole = list(mixture())
    got = [int(x) for x in DataLoader(mixture(), batch_size=None, num_workers=workers)]
    assert sorted(got) == sorted(whole)
    shares = max(workers, 1)
    for w in range(shares):
        share = whole[w::shares]
        assert [x for x in got if x in set(share)] == share


def test_torchdata_stateful_dataloader_resumes_the_mixture_per_worker():
    from torchdata.stateful_dataloader import StatefulDataLoader

    whole = sorted(mixture())
    loader = StatefulDataLoader(mixture(), batch_size=4, num_workers=2)
    head = [int(x) for batch in itertools.islice(loader, 5) for x in batch]
    state = loader.state_dict()
    resumed = StatefulDataLoader(mixture(), batch_size=4, num_workers=2)
    resumed.load_state_dict(state)
    rest = [int(x) for batch in resumed for x in batch]
    assert sorted(head + rest) == whole


def test_a_weight_change_at_a_resume_takes_effect_from_the_next_sample_and_loses_nothing(caplog):
    new = {"a": 0, "b": 1, "c": 1}
    with caplog.at_level(logging.WARNING, logger="accelerate_stateful"):
        items, mix = direct_run(lambda: mixture(), [10, 25], weights_at={10: new})
    assert_each_source_read_in_order(items)
    schedule = mix.state_dict()["position"]["schedule"]
    assert schedule == [[0, {"a": 1.0, "b": 1.0, "c": 2.0}], [10, new]]
    assert all(source_of(i) != "a" for i in items[10:]), "weight 0 from sample 10 on"
    assert items[:10] == list(mixture())[:10]
    lines = [r.getMessage() for r in caplog.records if "weights change" in r.getMessage()]
    assert len(lines) == 1 and "from global sample 10" in lines[0] and "{a: 0, b: 1, c: 1}" in lines[0]


def test_the_same_weights_at_a_resume_change_nothing_and_proportional_weights_are_the_same():
    items, mix = direct_run(lambda: mixture(), [10], weights_at={10: {"a": 2, "b": 2, "c": 4}})
    assert items == list(mixture())
    assert len(mix.state_dict()["position"]["schedule"]) == 1


def test_set_weights_applies_to_the_next_pass_and_a_pass_in_progress_keeps_its_own():
    mix = mixture()
    stream = iter(mix)
    head = list(itertools.islice(stream, 5))
    mix.set_weights({"a": 0, "b": 0, "c": 1})
    assert head + list(stream) == list(mixture()), "the pass in progress is unchanged"
    assert {source_of(i) for i in mix} == {"c"}, "the next pass draws with the new weights"
    assert mix.weights == {"a": 0.0, "b": 0.0, "c": 1.0}


def test_delivered_counts_per_source_from_a_live_mixture_and_from_states():
    mix = mixture()
    stream = iter(mix)
    items = list(itertools.islice(stream, 20))
    want = {name: sum(source_of(i) == name for i in items) for name in BASES}
    assert mix.delivered() == want
    state = mix.state_dict()
    assert mixture().delivered(state) == want
    assert mixture().delivered([state, state]) == {name: 2 * n for name, n in want.items()}
    assert mixture().delivered() == {"a": 0, "b": 0, "c": 0}


def test_stop_ends_the_epoch_at_the_first_draw_from_an_ended_source_and_restart_reads_it_again():
    stopped = list(mixture(sizes=(3, 30, 60)))
    assert sum(source_of(i) == "a" for i in stopped) == 3
    restarted = mixture(sizes=(3, 30, 60), on_exhausted="restart", samples_per_epoch=100)
    items, mix = direct_run(lambda: mixture(sizes=(3, 30, 60), on_exhausted="restart", samples_per_epoch=100),
                            [7, 40, 41])
    assert items == list(restarted) and len(items) == 100
    a_items = [i for i in items if source_of(i) == "a"]
    assert a_items == [0, 1, 2] * (len(a_items) // 3) + [0, 1, 2][: len(a_items) % 3]
    assert mix.state_dict()["position"]["restarts"]["a"] == (len(a_items) - 1) // 3


def test_hugging_face_sources_map_style_and_streaming_from_local_files(tmp_path):
    import datasets
    path = tmp_path / "b.jsonl"
    path.write_text("".join(json.dumps({"id": 1000 + i}) + "\n" for i in range(30)))
    datasets.disable_progress_bars()

    def make():
        streamed = datasets.load_dataset("json", data_files=str(path), split="train", streaming=True)
        mapped = datasets.Dataset.from_dict({"id": list(range(40))})
        return Mixture({"a": mapped, "b": streamed, "c": [{"id": 2000 + i} for i in range(60)]},
                       {"a": 1, "b": 1, "c": 2}, seed=5)

    whole = [row["id"] for row in make()]
    items, _ = direct_run(make, [9, 23])
    assert [row["id"] for row in items] == whole
    assert_each_source_read_in_order(whole)
    got = [int(row["id"]) for row in DataLoader(make(), batch_size=None, num_workers=2)]
    assert sorted(got) == sorted(whole), "a streaming source is read whole by every worker"


@pytest.mark.parametrize("weights,match", [
    ({"a": -1, "b": 1, "c": 1}, "weight of source 'a' is -1"),
    ({"a": 0, "b": 0, "c": 0}, "every weight is 0"),
    ({"a": 1, "b": 1}, r"no weight given for \['c'\]"),
    ({"a": 1, "b": 1, "c": 1, "d": 1}, r"no source is called \['d'\]"),
    ({"a": float("nan"), "b": 1, "c": 1}, "finite numbers"),
    ([1, 2, 3], "mapping from source name"),
])
def test_bad_weights_are_refused_in_the_users_terms(weights, match):
    with pytest.raises(UnsupportedConfigError, match=match):
        mixture(weights)
    with pytest.raises(UnsupportedConfigError, match=match):
        mixture().set_weights(weights)


def test_bad_sources_settings_and_states_are_refused_in_the_users_terms():
    with pytest.raises(UnsupportedConfigError, match="source 'x' .*generator.*no state_dict"):
        Mixture({"x": (i for i in range(3))}, {"x": 1})
    with pytest.raises(UnsupportedConfigError, match="non-empty mapping"):
        Mixture({}, {})
    with pytest.raises(UnsupportedConfigError, match="on_exhausted='again'.*'stop'.*'restart'"):
        mixture(on_exhausted="again")
    with pytest.raises(UnsupportedConfigError, match="samples_per_epoch=-1"):
        mixture(samples_per_epoch=-1)
    with pytest.raises(UnsupportedConfigError, match="source 'e' has no items"):
        list(Mixture({"e": [], "a": [1]}, {"e": 1, "a": 1}, on_exhausted="restart"))
    mix = mixture()
    list(itertools.islice(iter(mix), 5))
    state = mix.state_dict()
    fewer = Mixture({"a": list(range(40)), "c": list(range(60))}, {"a": 1, "c": 1})
    with pytest.raises(CheckpointError, match=r"source\(s\) \['b'\], which this Mixture does not have.*weight 0"):
        fewer.load_state_dict(state)  # refused at the load, before anything changes
    damaged = mixture()
    with pytest.raises(CheckpointError, match="not one it wrote"):
        damaged.load_state_dict({"index": 5, "position": {"next": 5}})


def test_a_source_added_at_a_resume_starts_at_its_beginning_from_the_switch_point():
    mix = Mixture({"a": list(range(40)), "c": [2000 + i for i in range(60)]}, {"a": 1, "c": 1}, seed=2)
    head = list(itertools.islice(iter(mix), 10))
    grown = mixture({"a": 1, "b": 1, "c": 1}, seed=2)
    grown.load_state_dict(mix.state_dict())
    items = head + list(grown)
    assert_each_source_read_in_order(items)
    assert any(source_of(i) == "b" for i in items[10:]) and all(source_of(i) != "b" for i in head)


def test_a_weight_change_without_the_packages_loader_is_refused_for_several_workers():
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(mixture(), batch_size=4, num_workers=2)
    list(itertools.islice(loader, 3))
    state = loader.state_dict()
    changed = mixture({"a": 1, "b": 1, "c": 1})
    resumed = StatefulDataLoader(changed, batch_size=4, num_workers=2)
    resumed.load_state_dict(state)
    with pytest.raises(Exception, match="2 DataLoader workers resume it.*accelerator.prepare"):
        list(resumed)

