"""``Mixture`` weight schedules (``Stages``, ``Ramp``): the weights of global sample ``k`` are a pure function of
``k``, so kills at every stage boundary and inside a ramp, on 0 to 3 workers and 1 to 3 processes (ranks simulated
in one process), resume the uninterrupted sequence; per-source sample and token counters in the saved state.

Every cell is checked against an oracle written from the documented rule alone: sample ``k`` comes from the source
that ``uniform(draw_key(seed, epoch), k)`` picks under ``schedule.weights_at(k)``.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import random
import re

import pytest
from torch.utils.data import DataLoader

from accelerate_stateful import DistContext, IterableShardDataLoader, Mixture, Ramp, Stages
from accelerate_stateful.errors import CheckpointError, UnsupportedConfigError
from accelerate_stateful.sources._mixture_draw import Table, draw_key, uniform

from cli_run import cli_json, run_cli, save_checkpoint
from test_mixture import BASES, mixture
from test_mixture_loader import _next_indices, _ranks_run, _sized, epoch, ids, run_chain

LENGTH, SEED = 84, 5  # _sized(): sources of 100 items, read again when drawn out, 84 samples an epoch
A, B, C = {"a": 1, "b": 1, "c": 0}, {"a": 0, "b": 1, "c": 2}, {"a": 3, "b": 0, "c": 1}
SCHEDULES = {
    "stages": Stages([(0, A), (12, B), (24, C)]),
    "ramp": Ramp(6, 30, A, C, block=4),
    "stages-then-ramp": Stages([(0, B), (12, Ramp(12, 36, B, A, block=1)), (36, C)]),
}
# Global sample indices to kill at: every stage boundary, and inside every ramp.
BOUNDARIES = {"stages": [12, 24], "ramp": [6, 30], "stages-then-ramp": [12, 36]}
INSIDE = {"stages": [], "ramp": [18], "stages-then-ramp": [21, 27]}


def expected(schedule, length=LENGTH, epoch=0, seed=SEED) -> list[int]:
    """The items of an epoch by the documented rule (sources read again from their start after 100 items)."""
    key, taken, items = draw_key(seed, epoch), dict.fromkeys(BASES, 0), []
    for k in range(length):
        name = Table(schedule.weights_at(k)).pick(uniform(key, k))
        items.append(BASES[name] + taken[name] % 100)
        taken[name] += 1
    return items


def test_stages_and_ramps_give_each_index_its_weights_evaluated_per_block():
    stages = SCHEDULES["stages"]
    assert [stages.weights_at(k) for k in (0, 11, 12, 23, 24, 10**9)] == [A, A, B, B, C, C]
    ramp = Ramp(10, 20, {"x": 1, "y": 0}, {"x": 0, "y": 1}, block=4)
    assert [ramp.weights_at(k)["y"] for k in (0, 9, 11, 12, 15, 16, 19, 20, 99)] == [
        0, 0, 0, 0.2, 0.2, 0.6, 0.6, 1, 1]  # 12..15 draw with the ramp at 12, 16..19 at 16; clamped outside
    inner = SCHEDULES["stages-then-ramp"]
    assert inner.weights_at(11) == B and inner.weights_at(24) == {"a": 0.5, "b": 1.0, "c": 1.0}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_the_mixture_draws_each_sample_with_the_schedules_weights_at_its_index_in_every_epoch(name):
    mix = mixture(SCHEDULES[name], seed=SEED, sizes=(100, 100, 100), on_exhausted="restart",
                  samples_per_epoch=LENGTH)
    assert list(mix) == expected(SCHEDULES[name])
    mix.set_epoch(1)
    assert list(mix) == expected(SCHEDULES[name], epoch=1)


def _cells():
    """Per schedule: no workers, killed at every boundary and inside point (each kill exact, in samples), then
    random worker counts (0 to 3 before and after each kill) killed at consecutive points."""
    rng = random.Random(28)
    for name in SCHEDULES:
        points = sorted(BOUNDARIES[name] + INSIDE[name])
        yield pytest.param(name, [0] * (len(points) + 1), [p // 3 for p in points], id=f"{name}-no-workers")
        for first, second in zip(points, points[1:]):
            workers = [rng.randrange(4) for _ in range(3)]
            yield pytest.param(name, workers, [first // 3, second // 3],
                               id=f"{name}-workers{'-'.join(map(str, workers))}-at{first}-{second}")


@pytest.mark.parametrize("name,workers,stops", list(_cells()))
def test_killed_at_stage_boundaries_and_inside_ramps_the_resume_is_the_uninterrupted_run(name, workers, stops,
                                                                                          caplog):
    schedule, sized = SCHEDULES[name], _sized()
    links = [(w, schedule, stop) for w, stop in zip(workers, stops + [None])]
    with caplog.at_level(logging.WARNING, logger="accelerate_stateful"):
        seen, states = run_chain(links, **sized)
    whole, _ = run_chain([(workers[0], schedule, None)], epochs=1, **sized)
    last, _ = run_chain([(workers[-1], schedule, None)], **sized)
    assert epoch(seen, 0) == whole, "the interrupted epoch is the uninterrupted one, batch for batch"
    assert epoch(seen, 1) == epoch(last, 1)
    assert sorted(ids(epoch(seen, 0))) == sorted(expected(schedule))
    assert sorted(ids(epoch(seen, 1))) == sorted(expected(schedule, epoch=1))
    assert not [r for r in caplog.records if "weights change" in r.getMessage()], "the same schedule is no change"
    if not any(workers):
        killed_at = {n for state in states[:-1] for n in _next_indices(state)}
        assert killed_at == set(BOUNDARIES[name] + INSIDE[name])


@pytest.mark.parametrize("name,dispatch", [("stages", False), ("ramp", False), ("stages-then-ramp", True)])
@pytest.mark.parametrize("before,after", [(2, 3), (2, 1)])
def test_across_a_process_count_change_nothing_is_lost_or_repeated(name, dispatch, before, after):
    """Two processes of two workers killed after two steps, their shares at samples 11 and 12: at the stage
    boundary 12, or inside the ramp 6..30; resumed on three processes or one (_sized: no rank pads)."""
    got = _ranks_run([(2, SCHEDULES[name], 2), (2, SCHEDULES[name], None)], before, after, dispatch)
    assert sorted(got) == sorted(expected(SCHEDULES[name]))


def test_another_schedule_at_a_resume_switches_at_the_first_unread_sample_and_says_so(caplog):
    old, new = SCHEDULES["stages"], SCHEDULES["ramp"]
    with caplog.at_level(logging.WARNING, logger="accelerate_stateful"):
        seen, states = run_chain([(2, old, 5), (0, new, None)], epochs=1, **_sized())
    switch = max(_next_indices(states[0]))
    assert switch == 15  # 5 batches of 3 from two shares of blocks of 3: share 0 took blocks 0, 2 and 4
    lines = [r.getMessage() for r in caplog.records if "weights change" in r.getMessage()]
    assert len(lines) == 1 and f"from global sample {switch} on: {old!r} -> {new!r}" in lines[0]
    key = draw_key(SEED, 0)
    drawn = [Table((old if k < switch else new).weights_at(k)).pick(uniform(key, k)) for k in range(LENGTH)]
    got = ids(seen)
    assert {n: sum(i // 1000 == "abc".index(n) for i in got) for n in "abc"} == {n: drawn.count(n) for n in "abc"}


def test_processes_with_different_schedules_are_refused_naming_both():
    from accelerate_stateful.checkpoint import _compare

    digests = []
    for rank, schedule in enumerate([SCHEDULES["stages"], Stages([(0, A), (13, B), (24, C)])]):
        loader = IterableShardDataLoader.from_dataloader(DataLoader(mixture(schedule), batch_size=2),
                                                         DistContext(rank, 2), data_seed=0)
        digests.append(loader._data_digest())
    refusal = _compare.data_refusal(digests, "accelerator.save_state()", 0)
    assert refusal == (
        "accelerator.save_state() refused for loader 0: the weights of Mixture is not the same on every process "
        "(rank 0: Stages([(0, {a: 1, b: 1, c: 0}), (12, {a: 0, b: 1, c: 2}), (24, {a: 3, b: 0, c: 1})]), "
        "rank 1: Stages([(0, {a: 1, b: 1, c: 0}), (13, {a: 0, b: 1, c: 2}), (24, {a: 3, b: 0, c: 1})])); "
        "call set_weights with the same weights on every process"
    )


@pytest.mark.parametrize("make,match", [
    (lambda: Stages([(5, A), (10, B)]), r"start at \[5, 10\]; the first must start at 0"),
    (lambda: Stages([(0, A), (10, B), (10, C)]), r"start at \[0, 10, 10\].*each later one after the one before"),
    (lambda: Stages([]), r"non-empty list of \(start, weights\) pairs"),
    (lambda: Stages([(0, A), (-1, B)]), r"non-empty list of \(start, weights\) pairs"),
    (lambda: Stages([(0, A), (9, {"a": 1, "b": 1})]), r"stage 1 \(from sample 9\) names the sources \['a', 'b'\]"),
    (lambda: Stages([(0, {"a": -1, "b": 1})]), r"stage 0: the weight of source 'a' is -1; weights must be finite"),
    (lambda: Stages([(0, {"a": math.inf, "b": 1})]), r"the weight of source 'a' is inf"),
    (lambda: Ramp(10, 10, A, B), r"Ramp\(start=10, end=10\).*0 <= start < end"),
    (lambda: Ramp(0, 10, A, B, block=0), r"Ramp\(block=0\)"),
    (lambda: Ramp(0, 10, A, {"a": 1, "b": 1}), r"w_to \(it must name the sources of w_from\).*no weight given for"),
    (lambda: Ramp(0, 10, A, {"a": 0, "b": 0, "c": 0}), r"every weight is 0"),
    (lambda: mixture(Stages([(0, {"a": 1, "x": 1})])), r"Mixture: Stages: the weights must name exactly the sources"),
    (lambda: mixture().set_weights(Ramp(0, 5, {"a": 1}, {"a": 2})), r"set_weights: Ramp.*no weight given for \['b', 'c'\]"),
], ids=["first-not-0", "not-increasing", "empty", "negative-start", "other-names", "negative-weight", "infinite",
        "empty-ramp", "block-0", "ramp-names", "all-zero", "mixture-names", "set-weights-names"])
def test_bad_schedules_are_refused_in_the_users_terms(make, match):
    with pytest.raises(UnsupportedConfigError, match=match):
        make()


def test_a_saved_schedule_round_trips_and_a_damaged_one_is_refused():
    made = lambda: mixture(SCHEDULES["stages-then-ramp"], sizes=(100, 100, 100))  # noqa: E731
    source = made()
    head = list(itertools.islice(iter(source), 25))
    state = json.loads(json.dumps(source.state_dict()))
    resumed = made()
    resumed.load_state_dict(state)
    assert head + list(itertools.islice(iter(resumed), 30)) == list(itertools.islice(iter(made()), 55))
    state["position"]["schedule"][0][1]["stages"][1][1]["ramp"]["end"] = 3  # ends before it starts
    with pytest.raises(CheckpointError, match="Mixture is not one it wrote"):
        made().load_state_dict(state)


def token_mixture() -> Mixture:
    docs = {"short": [[1] * (1 + i % 3) for i in range(50)], "long": [{"input_ids": [2] * (10 + i)} for i in range(50)],
            "image": ["pixels"] * 50}
    return Mixture(docs, Stages([(0, {"short": 1, "long": 0, "image": 1}), (10, {"short": 1, "long": 1, "image": 0})]),
                   seed=3)


def _tokens(item) -> int:
    return len(item["input_ids"]) if isinstance(item, dict) else 0 if isinstance(item, str) else len(item)


def test_tokens_per_source_are_the_lengths_of_the_delivered_items_in_the_state_and_through_workers():
    mix = token_mixture()
    items = list(itertools.islice(iter(mix), 30))
    position = mix.state_dict()["position"]
    kinds = {"short": list, "long": dict, "image": str}
    want = {n: sum(_tokens(i) for i in items if isinstance(i, kinds[n])) for n in kinds}
    assert position["tokens"] == want and mix.tokens() == {n: want[n] for n in sorted(want)}
    assert mix.delivered() == {n: sum(isinstance(i, kinds[n]) for i in items) for n in sorted(kinds)}
    loader = IterableShardDataLoader.from_dataloader(
        DataLoader(token_mixture(), batch_size=1, num_workers=2, collate_fn=list), DistContext(0, 1))
    passing = iter(loader)  # held: the pass (and its workers) must be live when the state is taken
    batches = [item for batch in itertools.islice(passing, 30) for item in batch]
    state = loader.state_dict()
    assert token_mixture().tokens(state) == {n: sum(_tokens(i) for i in batches if isinstance(i, kinds[n]))
                                              for n in sorted(kinds)}


def test_a_position_saved_before_tokens_were_counted_resumes_counting_from_zero():
    mix = token_mixture()
    list(itertools.islice(iter(mix), 12))
    state = mix.state_dict()
    del state["position"]["tokens"]
    resumed = token_mixture()
    resumed.load_state_dict(state)
    item = next(iter(resumed))
    assert sum(resumed.tokens().values()) == _tokens(item)


def test_inspect_shows_the_samples_and_tokens_drawn_from_each_source(tmp_path):
    loader = IterableShardDataLoader.from_dataloader(DataLoader(token_mixture(), batch_size=4, collate_fn=list),
                                                     DistContext(0, 1))
    taken = list(itertools.islice(iter(loader), 5))
    counts = token_mixture().delivered(loader.state_dict()), token_mixture().tokens(loader.state_dict())
    ckpt = save_checkpoint(tmp_path / "checkpoint_1", [[loader.state_dict()]])
    row = cli_json("inspect", ckpt)["loaders"][0]["ranks"][0]
    assert row["mixture_sources"] == {n: {"samples": counts[0][n], "tokens": counts[1][n]} for n in counts[0]}
    assert sum(c["samples"] for c in row["mixture_sources"].values()) == sum(len(b) for b in taken) == 20
    status, out, err = run_cli("inspect", ckpt)
    shown = "; ".join(f"{n} {counts[0][n]} samples, {counts[1][n]} tokens" for n in ("image", "long", "short"))
    assert status == 0 and f"  mixture sources, delivered in epoch 0 (all ranks): {shown}" in out.splitlines(), out


def test_the_schedules_example_of_the_docs_runs_as_written(capsys):
    from scripts import ROOT

    page = (ROOT / "docs" / "sources" / "mixture.md").read_text(encoding="utf-8")
    section = page.split("## Schedules", 1)[1]
    exec(re.search(r"```python\n(.*?)```", section, flags=re.S).group(1), {})
    assert "'code'" in capsys.readouterr().out
