"""``accelerate-stateful samples`` of a ``Packed(Filtered(...))`` stream: the source items each step's documents were.

Every token says where it came from: ``base * 10**6 + document * 1000 + offset`` (``a``: base 1, ``b``: 2, an
inner mixture's ``x``: 3, ``y``: 4; a single dataset's documents are base 1 and named by the document alone),
so the rows the real loaders yield say which pieces of which source documents each step holds, and the items
the tool names can be turned back into documents and tested with the predicate. Ranks are simulated in this
process. For several configurations (a filter that drops about half the documents and one that drops none,
over one dataset, a mixture or a mixture of mixtures; 1 to 3 ranks, 0 or 2 workers, the shard loader or the
dispatcher, ``split_batches``) the loaders run to a save point, are resumed from the files on another worker
count (the epoch's blocks dealt again) and run to a second one. From each checkpoint alone:

- every piece's token span and kept item number (the packer's document) are those of the rows yielded;
- a piece named by its source item is that document, and the predicate keeps it;
- the documents between the named ones are exactly the items the predicate keeps among the step's ``between``
  draws, in order, and the kept and dropped counts say so; with a filter that drops none, every piece is named;
- the steps' draws, one after the other, are the unfiltered source's own order from the epoch's start.
"""

from __future__ import annotations

import itertools
import json
import random
import zlib

import pytest
from torch.utils.data import DataLoader

from accelerate_stateful import DistContext, Filtered, IterableShardDataLoader, Mixture, Packed
from accelerate_stateful.checkpoint import _files

from cli_run import cli_json, run_cli, save_checkpoint
from stream_samples import answers, check_scopes, checked_across_a_resume, grid_params, run_steps, saved_after, stream_loader

BASES = {"a": 1, "b": 2, "inner/x": 3, "inner/y": 4}
NAMES = {base: name for name, base in BASES.items()}


def keep_half(document: list[int]) -> bool:
    """Keeps about half the documents, in no pattern of their numbers."""
    return zlib.crc32(str(document[0]).encode()) % 100 < 50


def keep_all(document: list[int]) -> bool:
    return True


def _documents(name: str, seed: int, count: int = 150) -> list[list[int]]:
    rng, base = random.Random(f"{seed}-{name}"), BASES[name] * 10**6
    return [[base + d * 1000 + t for t in range(rng.randint(1, 9))] for d in range(count)]


def _unfiltered(cfg: dict):
    """The source below the filter."""
    if cfg["below"] == "dataset":
        return _documents("a", cfg["seed"])
    sources = {"a": _documents("a", cfg["seed"]), "b": _documents("b", cfg["seed"])}
    if cfg["below"] == "nested":
        sources["inner"] = Mixture({"x": _documents("inner/x", cfg["seed"]), "y": _documents("inner/y", cfg["seed"])},
                                   {"x": 1, "y": 2}, seed=cfg["seed"])
    return Mixture(sources, {name: 1 + i for i, name in enumerate(sources)}, seed=cfg["seed"] + 1)


def _loader(cfg: dict, rank: int, workers: int):
    return stream_loader(Packed(Filtered(_unfiltered(cfg), cfg["keep"]), cfg["seq_len"]), cfg, rank, workers)


# (ranks, dispatcher, split_batches, workers before and after the resume, below the filter, predicate): six, so
# the suite's sample of a grid (tests/conftest.py) runs every one
_GRID = [(1, False, False, (0, 2), "mixture", keep_half), (2, True, False, (2, 0), "dataset", keep_all),
         (3, False, False, (0, 2), "nested", keep_half), (2, True, True, (2, 0), "mixture", keep_half),
         (2, False, False, (2, 0), "dataset", keep_half), (3, True, True, (0, 2), "mixture", keep_all)]


def _named(item: dict) -> tuple:
    """A named source item as (source, document), a single dataset's under ``a``."""
    return item["source"] or "a", item["document"]


def _document(cfg: dict, named: tuple) -> list[int]:
    source, document = named
    return _documents(source, cfg["seed"])[document]


def _pieces(rows: list[list[int]]) -> list[dict]:
    """The pieces of source documents that ``rows`` (in order) hold: ``{"named", "start", "stop"}``, ``stop`` the
    offset after the piece's last token."""
    found: list[dict] = []
    for token in (t for row in rows for t in row):
        named, offset = (NAMES[token // 10**6], token % 10**6 // 1000), token % 1000
        if found and found[-1]["named"] == named:
            found[-1]["stop"] = offset + 1
        else:
            found.append({"named": named, "start": offset, "stop": offset + 1})
    return found


def _check_step(answer: dict, rows: list, cfg: dict, kept: list[tuple]) -> list[tuple]:
    """One step's answer against its rows; returns the source items it names as drawn, in order."""
    expected, pieces = _pieces(rows), answer["pieces"]
    assert len(pieces) == len(expected)
    for piece, truth in zip(pieces, expected):
        stop = None if truth["stop"] == len(_document(cfg, truth["named"])) else truth["stop"]
        assert (piece["start"], piece["stop"]) == (truth["start"], stop)
        assert kept[piece["item"]] == truth["named"]  # the packer's document: the filter's kept item
        if not piece.get("between"):
            assert _named(piece) == truth["named"] and cfg["keep"](_document(cfg, truth["named"]))
    between = answer["between"]
    drawn = [_named(item) for item in between["drawn"]]
    inside = [truth["named"] for piece, truth in zip(pieces, expected) if piece.get("between")]
    if inside:  # else each document there is named: every item drawn was one (the filter dropped none)
        assert [named for named in drawn if cfg["keep"](_document(cfg, named))] == inside
    assert between["kept"] == sum(cfg["keep"](_document(cfg, named)) for named in drawn)
    assert between["dropped"] == len(drawn) - between["kept"]
    if cfg["keep"] is keep_all:
        assert not inside and between["dropped"] == 0
    first = [_named(pieces[0])] if pieces[0]["start"] else []  # a document begun in the step before
    return first + drawn + [_named(pieces[-1])]


def _check(ckpt, taken: list, cfg: dict) -> None:
    out = cli_json("samples", ckpt, "--consumed")
    unfiltered = [_pieces([doc[:1]])[0]["named"] for doc in itertools.islice(iter(_unfiltered(cfg)), 3000)]
    kept = [named for named in unfiltered if cfg["keep"](_document(cfg, named))]
    in_order: list[tuple] = []  # the items of every step (each rank's part where each is named), in global order
    for answer, rows, counted in answers(out, taken, cfg):
        items = _check_step(answer, rows, cfg, kept)
        in_order += items if counted else []
    in_order = [named for i, named in enumerate(in_order) if i == 0 or in_order[i - 1] != named]
    assert in_order == unfiltered[:len(in_order)]
    check_scopes(out, cfg)


@pytest.mark.parametrize("cfg", grid_params(_GRID, 37, seq_len=[3, 5]))
def test_samples_name_the_source_items_of_a_packed_filters_documents_across_a_resume_on_other_workers(tmp_path,
                                                                                                       cfg):
    checked_across_a_resume(tmp_path, cfg, _loader, _check)


def even_first(document: list[int]) -> bool:
    return document[0] % 2 == 0


# document d is [d] * its length; even_first keeps the documents of even number
DOCS = [[d] * n for d, n in enumerate([2, 1, 4, 3, 1, 5, 2, 2, 3, 1, 2, 4, 1, 2, 6, 1, 3, 2, 1, 1] * 3)]


def test_a_packed_filter_step_names_its_end_documents_and_lists_the_draws_between_them(tmp_path):
    ckpt, taken = saved_after(tmp_path, Packed(Filtered(DOCS, even_first), 3))
    assert taken == [[[[0, 0, 2], [2, 2, 2]], [[4, 6, 6], [8, 8, 8]], [[10, 10, 12], [14, 14, 14]]]]
    status, out, _ = run_cli("samples", ckpt, "--consumed")
    assert status == 0 and "the predicate's decision: run it on them to tell" in out
    # step 1 ends document 8 and begins none: 4 and 6 are the two of 3 to 7 the predicate kept; document 2 ended
    # step 0 whole, so step 1 names none at its start
    assert out.splitlines()[-3:] == ["step 0 (this rank): [1 of 0 1] 2",
                                     "step 1 (this rank): [2 of 3 4 5 6 7] 8",
                                     "step 2 (this rank): [2 of 9 10 11 12 13] 14[:3]"]


def test_a_filter_dropping_nothing_below_a_packer_names_every_document(tmp_path):
    ckpt, _ = saved_after(tmp_path, Packed(Filtered(DOCS, bool), 3))
    status, out, _ = run_cli("samples", ckpt, "--consumed")
    assert status == 0 and " of " not in "".join(out.splitlines()[3:])
    assert out.splitlines()[-3:] == ["step 0 (this rank): 0 1 2[:3]", "step 1 (this rank): 2[3:] 3 4 5[:1]",
                                     "step 2 (this rank): 5[1:] 6"]


def _old(tmp_path, source, steps: int):
    """A checkpoint of ``source`` read by 2 workers for ``steps`` steps, as a release before packers noted their
    filter's draws wrote it: marks of 3 numbers."""
    ckpt, _ = saved_after(tmp_path, source, steps, num_workers=2)
    state = _files.read_loader_state(ckpt, 0, 0)
    for snap in state["stream"]["snapshots"]:
        dataset = snap["dataset"]
        dataset.pop("mark_width", None)
        dataset["marks"] = [v for i, v in enumerate(dataset["marks"]) if i % 4 != 3]
    return save_checkpoint(tmp_path / "old", [[state]])


def _resumed(ckpt, source, workers: int = 0):
    loader = IterableShardDataLoader.from_dataloader(DataLoader(source, batch_size=2, num_workers=workers),
                                                     DistContext(0, 1))
    loader.load_state_dict(_files.read_loader_state(ckpt, 0, 0))
    return loader


def _widths(loader) -> list:
    """The mark width each share's state says (``None``: not said, 3) and whether its marks are of it."""
    datasets = [snap["dataset"] for snap in loader.state_dict()["stream"]["snapshots"]]
    return [(d.get("mark_width"), bool(d["marks"]) and len(d["marks"]) % d.get("mark_width", 3) == 0)
            for d in datasets]


def test_the_epoch_after_one_resumed_from_marks_of_three_numbers_notes_four_and_is_named(tmp_path):
    source = Packed(Filtered(DOCS[:30], even_first), 3)
    resumed = _resumed(_old(tmp_path, source, 3), source)
    assert len(list(resumed)) > 1  # the rest of the epoch, regrouped from 2 workers to none; the next one starts
    resumed = _resumed(save_checkpoint(tmp_path / "mid", [[resumed.state_dict()]]), source)
    run_steps([resumed], 2, [])
    assert _widths(resumed) == [(4, True)]
    status, out, _ = run_cli("samples", save_checkpoint(tmp_path / "next", [[resumed.state_dict()]]), "--consumed")
    assert status == 0 and out.splitlines()[-2:] == ["step 0 (this rank): [1 of 0 1] 2",
                                                     "step 1 (this rank): [2 of 3 4 5 6 7] 8"]


@pytest.mark.parametrize("workers", [0, 2], ids=["regrouped-to-no-workers", "the-same-two-workers"])
def test_an_old_epoch_continued_by_this_release_notes_its_marks_as_before_and_answers_as_before(tmp_path, workers):
    source = Packed(Filtered(DOCS, even_first), 3)
    resumed = _resumed(_old(tmp_path, source, 1), source, workers)  # worker 0's share has noted a mark, 1's none
    taken = run_steps([resumed], 3, [])
    assert _widths(resumed) == [(None, True)] * max(workers, 1)
    later = save_checkpoint(tmp_path / "later", [[resumed.state_dict()]])
    status, out, err = run_cli("samples", later, "--step", "3", "--json")
    assert status == 4 and "written since packers note their filter's draws" in err
    kept = [d for d, doc in enumerate(DOCS) if even_first(doc)]
    pieces = json.loads(out)["ranks"][0]["batches"][0]["pieces"]
    tokens = [t for row in taken[0][2] for t in row]
    assert [kept[p["item"]] for p in pieces] == list(dict.fromkeys(tokens))
    _resumed(later, source)  # its marks are well formed: a resume loads them


def test_a_packed_filter_step_around_rows_left_out_is_refused_since_those_rows_were_read_but_not_trained(tmp_path):
    ckpt, _ = saved_after(tmp_path, Packed(Filtered(DOCS, even_first), 3), skip=(3, 4))
    status, _, err = run_cli("samples", ckpt, "--step", "1")
    assert status == 4 and "packed rows left out by skip_samples" in err
    status, out, _ = run_cli("samples", ckpt, "--step", "0")
    assert status == 0 and out.splitlines()[-1] == "step 0 (this rank): [1 of 0 1] 2"
