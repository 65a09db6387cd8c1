"""``accelerate-stateful samples`` of a ``Packed`` stream: the documents each taken step's rows were cut from.

Every token says where it came from: ``base * 10**6 + document * 1000 + offset`` (``a``: base 1, ``b``: 2, an
inner mixture's ``x``: 3, ``y``: 4), so the rows the real loaders yield say which pieces of which documents
each step holds. Ranks are simulated in this process. For random configurations (document lengths, row
lengths, weights, 1 to 3 ranks, 0 or 2 workers, the shard loader or the dispatcher, ``split_batches``, a
mixture of mixtures) the loaders run to a save point, are resumed from the files on another worker count (the
epoch's blocks dealt again) and run to a second one: the tool's answers from each checkpoint alone must equal
the pieces of what the loaders yielded, for the rank where the checkpoint can tell a rank's part, for all
ranks together where it cannot.
"""

from __future__ import annotations

import random

import pytest

from accelerate_stateful import Mixture, Packed
from accelerate_stateful.checkpoint import _files

from cli_run import cli_json, run_cli, save_checkpoint
from stream_samples import check_scopes, checked_across_a_resume, saved_after, stream_loader

BASES = {"a": 1, "b": 2, "inner/x": 3, "inner/y": 4}
NAMES = {base: name for name, base in BASES.items()}


def _documents(name: str, rng: random.Random, count: int = 200) -> list[list[int]]:
    base = BASES[name] * 10**6
    return [[base + d * 1000 + t for t in range(rng.randint(1, 11))] for d in range(count)]


def _lengths(cfg: dict) -> dict[str, list[int]]:
    rng = random.Random(cfg["seed"])
    return {name: [len(doc) for doc in _documents(name, rng)] for name in BASES}


def _source(cfg: dict) -> Packed:
    rng = random.Random(cfg["seed"])
    docs = {name: _documents(name, rng) for name in BASES}
    sources = {"a": docs["a"], "b": docs["b"]}
    if cfg["nested"]:
        sources["inner"] = Mixture({"x": docs["inner/x"], "y": docs["inner/y"]}, {"x": 1, "y": 2}, seed=cfg["seed"])
    weights = {name: 1 + i for i, name in enumerate(sources)}
    return Packed(Mixture(sources, weights, seed=cfg["seed"] + 1), cfg["seq_len"])


def _loader(cfg: dict, rank: int, workers: int):
    return stream_loader(_source(cfg), cfg, rank, workers)


def _configs(count: int = 8) -> list:
    rng = random.Random(29)
    found = []
    for n in range(count):
        world = 1 + n % 3
        cfg = dict(world=world, seed=rng.randrange(1000), seq_len=rng.choice([3, 5]), dispatch=n % 4 in (1, 3),
                   split=n % 4 == 3 and world > 1, workers=[(0, 2), (2, 0)][n % 2], nested=n % 3 == 2,
                   stops=sorted(rng.sample(range(1, 7), 2)))
        cfg["bs"] = 2 * world if cfg["split"] else 2
        name = "-".join(f"{k}{v}" for k, v in cfg.items() if k in ("world", "dispatch", "split", "workers", "nested"))
        found.append(pytest.param(cfg, id=name.replace(" ", "").replace(",", "")))
    return found


def _pieces(rows: list[list[int]], lengths: dict[str, list[int]]) -> list[dict]:
    """The pieces of documents that ``rows`` (in order) hold, as ``samples`` names them."""
    found: list[dict] = []
    for token in (t for row in rows for t in row):
        name, document, offset = NAMES[token // 10**6], token % 10**6 // 1000, token % 1000
        if found and (found[-1]["source"], found[-1]["document"]) == (name, document):
            found[-1]["stop"] = offset + 1
        else:
            found.append({"source": name, "document": document, "start": offset, "stop": offset + 1})
    for piece in found:
        if piece["stop"] == lengths[piece["source"]][piece["document"]]:
            piece["stop"] = None  # to the document's end
    return found


def _expected(taken: list, cfg: dict, answer: dict, rank: int, step: int) -> list[dict]:
    if answer["rows"] == "this rank":
        rows = taken[rank][step]
    else:
        rows = [row for r in range(cfg["world"]) for row in taken[r][step]]
    return _pieces(rows, _lengths(cfg))


def _check(ckpt, taken: list, cfg: dict) -> None:
    out = cli_json("samples", ckpt, "--consumed")
    for rank, found in enumerate(out["ranks"]):
        assert [b["step"] for b in found["batches"]] == list(range(len(taken[rank])))
        for answer in found["batches"]:
            got = [{k: p[k] for k in ("source", "document", "start", "stop")} for p in answer["pieces"]]
            assert got == _expected(taken, cfg, answer, rank, answer["step"]), (rank, answer["step"], answer["rows"])
    check_scopes(out, cfg)


@pytest.mark.parametrize("cfg", _configs())
def test_samples_name_the_documents_each_packed_step_was_cut_from_across_a_resume_on_other_workers(tmp_path, cfg):
    checked_across_a_resume(tmp_path, cfg, _loader, _check)


def test_empty_documents_are_named_in_the_step_whose_rows_the_packer_read_them_for(tmp_path):
    docs = [[10, 11, 12], [], [20, 21, 22, 23, 24], [], [], [30], [40, 41, 42, 43], [50, 51, 52, 53, 54, 55]]
    ckpt, taken = saved_after(tmp_path, Packed(docs, 2), steps=3)
    assert taken == [[[[10, 11], [12, 20]], [[21, 22], [23, 24]], [[30, 40], [41, 42]]]]
    status, out, _ = run_cli("samples", ckpt, "--consumed")
    assert status == 0
    # the empty documents 3 and 4 come after step 1's last token: the packer reads them for step 2
    assert out.splitlines()[-3:] == ["step 0 (this rank): 0 1 2[:1]", "step 1 (this rank): 2[1:]",
                                     "step 2 (this rank): 3 4 5 6[:3]"]


def test_a_packed_checkpoint_written_before_packers_counted_documents_is_refused_with_the_reason(tmp_path):
    ckpt, _ = saved_after(tmp_path, Packed([[1, 2, 3]] * 20, 2), steps=2)
    state = _files.read_loader_state(ckpt, 0, 0)
    for snap in state["stream"]["snapshots"]:
        snap["dataset"].pop("marks")
        for key in ("documents", "offset"):
            snap["dataset"]["position"].pop(key)
    old = save_checkpoint(tmp_path / "old", [[state]])
    status, out, err = run_cli("samples", old, "--consumed")
    assert status == 4 and out == ""
    assert "outermost source is a Packed: which documents a packed row is cut from depends on the documents' " \
           "lengths" in err


def test_a_packed_step_around_rows_left_out_is_refused_since_those_rows_were_read_but_not_trained(tmp_path):
    ckpt, _ = saved_after(tmp_path, Packed([[1, 2, 3]] * 40, 2), skip=(3, 4))
    status, _, err = run_cli("samples", ckpt, "--step", "1")
    assert status == 4 and "rows left out by skip_samples" in err
