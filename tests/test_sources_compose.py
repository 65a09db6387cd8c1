"""The composable sources stacked: a change a mixture agrees on reaches it through Packed, is refused under a
shuffle buffer that must re-read what it held, and a shuffled datasets stream is refused as a child."""

from __future__ import annotations

import itertools
import json

import datasets
import pytest

from accelerate_stateful.errors import UnsupportedConfigError
from accelerate_stateful.sources import Mixture, Packed, Shuffled, exact_shuffle
from accelerate_stateful.sources._global import agree_states


def docs(tag: str, n: int) -> list[dict]:
    return [{"input_ids": [hash((tag, i, j)) % 1000 for j in range(1 + (i * 7) % 9)]} for i in range(n)]


def mixture(weights: dict) -> Mixture:
    return Mixture({"a": docs("a", 40), "b": docs("b", 40)}, weights, seed=3)


STACKS = {
    "packed": lambda w: Packed(mixture(w), seq_len=6),
    "shuffled": lambda w: Shuffled(mixture(w), buffer_size=5, seed=1),
    "packed-shuffled": lambda w: Packed(Shuffled(mixture(w), buffer_size=5, seed=1), seq_len=6),
}
OLD, NEW = {"a": 1.0, "b": 2.0}, {"a": 1.0, "b": 1.0}


def rows(stream) -> list:
    return [json.dumps(row["input_ids"].tolist() if isinstance(row, dict) and "position_ids" in row else row)
            for row in stream]


@pytest.mark.parametrize("stack", list(STACKS))
@pytest.mark.parametrize("cut", [0, 3, 7])
def test_agreement_passes_through_a_stack_and_changes_nothing_without_a_change(stack, cut):
    full = rows(STACKS[stack](OLD))
    fresh = STACKS[stack](OLD)
    started, lines = agree_states(fresh, [None])
    fresh.load_state_dict(started[0])
    assert rows(fresh) == full and lines == []  # a fresh pass's agreed start is the start

    run = STACKS[stack](OLD)
    head = rows(itertools.islice(iter(run), cut))
    saved = json.loads(json.dumps(run.state_dict()))
    resumed = STACKS[stack](OLD)
    agreed, lines = agree_states(resumed, [saved])
    resumed.load_state_dict(agreed[0])
    assert head + rows(resumed) == full and lines == []


def test_a_weight_change_reaches_a_mixture_under_packed_and_loses_no_document():
    run = STACKS["packed"](OLD)
    list(itertools.islice(iter(run), 5))
    saved = json.loads(json.dumps(run.state_dict()))
    resumed = STACKS["packed"](NEW)
    agreed, lines = agree_states(resumed, [saved])
    assert len(lines) == 1 and "{a: 1, b: 2} -> {a: 1, b: 1}" in lines[0]
    assert agreed[0]["position"]["carry"] == saved["position"]["carry"]  # the packer's carry is kept


@pytest.mark.parametrize("stack", ["shuffled", "packed-shuffled"])
def test_a_weight_change_under_a_shuffle_buffer_is_refused_with_the_fix(stack):
    run = STACKS[stack](OLD)
    list(itertools.islice(iter(run), 4))
    saved = json.loads(json.dumps(run.state_dict()))
    with pytest.raises(UnsupportedConfigError, match=r"shuffle each source below the mixture"):
        agree_states(STACKS[stack](NEW), [saved])


def test_a_shuffled_datasets_stream_is_refused_as_a_child_and_exact_shuffle_is_named(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"input_ids": [i, i + 1]}) + "\n" for i in range(20)))
    stream = datasets.load_dataset("json", data_files=str(path), split="train", streaming=True)
    # refused where the pipeline is built, in the user's script on every process, before any worker reads
    with pytest.raises(UnsupportedConfigError, match=r"Packed's source .*pass exact_shuffle\(dataset\) instead"):
        Packed(stream.shuffle(seed=1, buffer_size=4), seq_len=4)
    with pytest.raises(UnsupportedConfigError, match=r"Mixture source 's' .*make shuffle\(\) its last step"):
        Mixture({"s": stream.shuffle(seed=1, buffer_size=4).map(lambda row: row)}, {"s": 1.0})
    with pytest.raises(UnsupportedConfigError, match=r"Shuffled's source .*exact_shuffle"):
        Shuffled(stream.shuffle(seed=1, buffer_size=4), buffer_size=3)
    assert len(list(Packed(exact_shuffle(stream.shuffle(seed=1, buffer_size=4)), seq_len=4))) == 10
    assert len(list(Packed(stream, seq_len=4))) == 10
