"""Packed: rows of exactly seq_len tokens, documents carried over, resumed exactly from any row."""

from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from accelerate_stateful.errors import CheckpointError, UnsupportedConfigError
from accelerate_stateful.sources.packed import Packed


def reference(documents, seq_len, last="drop", pad_id=0):
    """Rows packed the obvious way: all tokens end to end, a piece starting at each document and each row."""
    tokens = [(t, i == 0) for doc in documents for i, t in enumerate(doc)]
    rows = []
    for start in range(0, len(tokens), seq_len):
        chunk = tokens[start:start + seq_len]
        if len(chunk) < seq_len and last == "drop":
            break
        ids, positions, at = [], [], 0
        for j, (token, first) in enumerate(chunk):
            at = 0 if first or j == 0 else at + 1
            ids.append(token)
            positions.append(at)
        fill = seq_len - len(ids)
        rows.append((ids + [pad_id] * fill, positions + list(range(fill))))
    return rows


def as_tuples(rows):
    return [(r["input_ids"].tolist(), r["position_ids"].tolist()) for r in rows]


def random_documents(rng, seq_len):
    """Documents of every kind of length: empty, short, exactly seq_len, several rows long."""
    lengths = [rng.choice([0, 1, 2, seq_len - 1, seq_len, seq_len + 1, 3 * seq_len + 2, rng.randrange(4 * seq_len)])
               for _ in range(rng.randrange(0, 12))]
    counter = itertools.count(1)
    return [[next(counter) for _ in range(max(n, 0))] for n in lengths]


CONFIGS = [(seed, seq_len, last) for seed in range(12) for seq_len in (1, 3, 7) for last in ("drop", "pad")]


@pytest.mark.parametrize("seed,seq_len,last", CONFIGS)
def test_rows_are_the_tokens_end_to_end_and_a_resume_at_every_row_continues_them(seed, seq_len, last):
    rng = random.Random(seed)
    documents = random_documents(rng, seq_len)
    source = [{"input_ids": d, "text": "x"} for d in documents]
    whole = as_tuples(Packed(source, seq_len, last=last, pad_id=-1))
    assert whole == reference(documents, seq_len, last, pad_id=-1)
    for cut in range(len(whole) + 1):
        packed = Packed(source, seq_len, last=last, pad_id=-1)
        head = as_tuples(itertools.islice(iter(packed), cut))
        saved = json.loads(json.dumps(packed.state_dict()))  # what a checkpoint file holds
        again = Packed(source, seq_len, last=last, pad_id=-1)
        again.load_state_dict(saved)
        assert head + as_tuples(again) == whole, f"cut after row {cut}"


def test_position_ids_restart_at_each_document_and_each_row_and_the_carry_is_in_the_position():
    docs = [[1, 2, 3], [], [4, 5, 6, 7, 8, 9, 10, 11, 12], [13]]
    packed = Packed(docs, seq_len=4)
    rows = iter(packed)
    assert as_tuples([next(rows)]) == [([1, 2, 3, 4], [0, 1, 2, 0])]
    # three documents read this epoch (one empty); the carry begins at token 1 of the third (index 2)
    assert packed.state_dict() == {"index": 1, "position": {"source": 3, "carry": [5, 6, 7, 8, 9, 10, 11, 12],
                                                                  "seq_len": 4, "documents": 3, "offset": 1}}
    assert as_tuples(rows) == [([5, 6, 7, 8], [0, 1, 2, 3]), ([9, 10, 11, 12], [0, 1, 2, 3])]
    assert as_tuples(Packed(docs, seq_len=5, last="pad", pad_id=0)) == [
        ([1, 2, 3, 4, 5], [0, 1, 2, 0, 1]), ([6, 7, 8, 9, 10], [0, 1, 2, 3, 4]), ([11, 12, 13, 0, 0], [0, 1, 0, 0, 1])]


def test_tokens_may_be_lists_tuples_tensors_or_arrays_under_any_key():
    docs = [{"ids": torch.tensor([1, 2])}, {"ids": np.array([3, 4, 5], dtype=np.int32)}, {"ids": (6,)}]
    assert as_tuples(Packed(docs, 3, key="ids")) == [([1, 2, 3], [0, 1, 0]), ([4, 5, 6], [0, 1, 0])]
    assert as_tuples(Packed([[1, 2], [3, 4]], 2)) == [([1, 2], [0, 1]), ([3, 4], [0, 1])]


def test_rows_collate_into_batch_by_seq_len_tensors():
    batches = list(DataLoader(Packed([[1, 2, 3, 4]] * 3, 2), batch_size=2))
    assert [b["input_ids"].shape for b in batches] == [(2, 2)] * 3
    assert batches[0]["position_ids"].dtype == torch.long


@pytest.mark.parametrize("kwargs,match", [
    pytest.param({"seq_len": 0}, r"seq_len=0.*at least one token", id="seq_len-0"),
    pytest.param({"seq_len": 2.5}, r"seq_len=2.5", id="seq_len-float"),
    pytest.param({"seq_len": 4, "last": "keep"}, r"last='keep'.*'drop'.*'pad'", id="last-unknown"),
    pytest.param({"seq_len": 4, "pad_id": None}, r"pad_id=None", id="pad-id-none"),
])
def test_settings_that_cannot_pack_are_refused_at_construction(kwargs, match):
    with pytest.raises(UnsupportedConfigError, match=match):
        Packed([[1]], **kwargs)


@pytest.mark.parametrize("documents,match", [
    pytest.param([{"input_ids": [1]}, {"text": "hi"}], r"document 2 .*no 'input_ids' field.*pass key=", id="no-key"),
    pytest.param([["a", "b"]], r"document 1 .*a str \('a'\).*token ids \(ints\).*tokenize", id="strings"),
    pytest.param([{"input_ids": [1.5]}], r"a float \(1.5\).*under 'input_ids'", id="floats"),
    pytest.param([torch.tensor([0.5])], r"a Tensor", id="float-tensor"),
    pytest.param(["some text"], r"a str \('some text'\)", id="text"),
])
def test_documents_that_are_not_token_ids_are_refused_in_the_users_terms(documents, match):
    with pytest.raises(UnsupportedConfigError, match=match):
        list(Packed(documents, 2))


def test_a_foreign_position_is_refused():
    packed = Packed([[1, 2]], 2)
    with pytest.raises(CheckpointError, match="Packed source is not one it wrote"):
        packed.load_state_dict({"index": 1, "position": {"offset": 3}})  # refused at the load
