"""``accelerate-stateful samples`` of a ``Filtered`` stream: the source items each taken step drew.

Every item says where it came from: ``base * 10**6 + document`` (``a``: base 1, ``b``: 2, an inner mixture's
``x``: 3, ``y``: 4; a single dataset's items are ``10**6 + document`` and named by the document alone), so the
drawn items the tool names can be turned back into items and tested with the predicate. Ranks are simulated
in this process. For several configurations (a filter that drops about 45 % of the items and one that drops
none, over one dataset, a mixture, a mixture of mixtures or a ``Shuffled`` buffer; 1 to 3 ranks, 0 or 2
workers, the shard loader or the dispatcher, ``split_batches``) the loaders run to a save point, are resumed
from the files on another worker count (the epoch's blocks dealt again) and run to a second one. From each
checkpoint alone: the items the predicate keeps among a step's drawn items must be exactly the rows the
loaders yielded for it, in order (the rank's, or all ranks' in rank order where the checkpoint cannot tell a
rank's part); the kept and dropped counts must say so; and the steps' draws, one after the other, must be the
unfiltered source's own order from the epoch's start, nothing skipped or named twice.
"""

from __future__ import annotations

import itertools
import json
import zlib

import pytest

from accelerate_stateful import Filtered, Mixture, Packed, Shuffled
from accelerate_stateful.checkpoint import _files

from cli_run import cli_json, run_cli, save_checkpoint
from stream_samples import answers, check_scopes, checked_across_a_resume, grid_params, saved_after, stream_loader

BASES = {"a": 1, "b": 2, "inner/x": 3, "inner/y": 4}


def keep_most(item: int) -> bool:
    """Keeps about 55 % of the items, in no pattern of their numbers."""
    return zlib.crc32(str(item).encode()) % 100 < 55


def keep_all(item: int) -> bool:
    return True


def _items(name: str, count: int = 300) -> list[int]:
    return [BASES[name] * 10**6 + d for d in range(count)]


def _unfiltered(cfg: dict):
    """The source below the filter."""
    if cfg["below"] == "dataset":
        return _items("a")
    sources = {"a": _items("a"), "b": _items("b")}
    if cfg["below"] == "nested":
        sources["inner"] = Mixture({"x": _items("inner/x"), "y": _items("inner/y")}, {"x": 1, "y": 2},
                                   seed=cfg["seed"])
    mixed = Mixture(sources, {name: 1 + i for i, name in enumerate(sources)}, seed=cfg["seed"] + 1)
    return Shuffled(mixed, buffer_size=8, seed=cfg["seed"]) if cfg["below"] == "shuffled" else mixed


def _loader(cfg: dict, rank: int, workers: int):
    return stream_loader(Filtered(_unfiltered(cfg), cfg["keep"]), cfg, rank, workers)


# (ranks, dispatcher, split_batches, workers before and after the resume, below the filter, predicate): six, so
# the suite's sample of a grid (tests/conftest.py) runs every one
_GRID = [(1, False, False, (0, 2), "mixture", keep_most), (2, True, False, (2, 0), "dataset", keep_all),
         (3, False, False, (0, 2), "nested", keep_most), (2, True, True, (2, 0), "shuffled", keep_most),
         (2, False, False, (2, 0), "mixture", keep_all), (3, True, True, (0, 2), "dataset", keep_most)]


def _item(named: dict) -> int:
    """The item a drawn source item names (a single dataset's: source ``None``)."""
    return BASES[named["source"] or "a"] * 10**6 + named["document"]


def _check(ckpt, taken: list, cfg: dict) -> None:
    out = cli_json("samples", ckpt, "--consumed")
    in_order = []  # the draws of every step (every rank's part where each rank's is named), in global order
    for answer, rows, counted in answers(out, taken, cfg):
        drawn = [_item(named) for named in answer["drawn"]]
        assert [item for item in drawn if cfg["keep"](item)] == rows, (answer["step"], rows)
        assert (answer["kept"], answer["dropped"]) == (len(rows), len(drawn) - len(rows))
        in_order += drawn if counted else []
    assert in_order == list(itertools.islice(iter(_unfiltered(cfg)), len(in_order)))
    check_scopes(out, cfg)


@pytest.mark.parametrize("cfg", grid_params(_GRID, 31))
def test_samples_name_the_source_items_each_filtered_step_drew_across_a_resume_on_other_workers(tmp_path, cfg):
    checked_across_a_resume(tmp_path, cfg, _loader, _check)


def odd(item: int) -> bool:
    return item % 2 == 1


def test_a_filtered_step_lists_its_drawn_items_and_says_the_predicate_decides_which_were_kept(tmp_path):
    ckpt, taken = saved_after(tmp_path, Filtered([1, 3, 4, 6, 8, 5, 7, 2, 9, 11, 13, 15], odd), steps=3)
    assert taken == [[[1, 3], [5, 7], [9, 11]]]
    status, out, _ = run_cli("samples", ckpt, "--consumed")
    assert status == 0
    assert "which of them were kept is the predicate's decision: run it on them to tell" in out
    # the dataset's items 2, 3 and 4 (4, 6 and 8) were drawn and dropped on the way to step 1's rows
    assert out.splitlines()[-3:] == ["step 0 (this rank): 2 kept, 0 dropped of 2 drawn: 0 1",
                                     "step 1 (this rank): 2 kept, 3 dropped of 5 drawn: 2 3 4 5 6",
                                     "step 2 (this rank): 2 kept, 1 dropped of 3 drawn: 7 8 9"]


def test_a_filtered_checkpoint_written_before_filters_noted_their_draws_is_refused_with_the_reason(tmp_path):
    ckpt, _ = saved_after(tmp_path, Filtered(list(range(40)), odd), steps=3)
    state = _files.read_loader_state(ckpt, 0, 0)
    for snap in state["stream"]["snapshots"]:
        snap["dataset"].pop("marks")
    old = save_checkpoint(tmp_path / "old", [[state]])
    status, out, err = run_cli("samples", old, "--step", "1")
    assert status == 4 and out == ""
    assert "it was written before filters noted their draws at each worker batch's end" in err


def test_a_filtered_step_around_rows_left_out_is_refused_since_those_rows_were_read_but_not_trained(tmp_path):
    ckpt, _ = saved_after(tmp_path, Filtered(list(range(80)), odd), skip=(3, 4))
    status, _, err = run_cli("samples", ckpt, "--step", "1")
    assert status == 4 and "filtered rows left out by skip_samples" in err


def test_a_filter_below_a_mixture_is_still_named_by_its_item_number_with_the_reason(tmp_path):
    source = Mixture({"odd": Filtered(list(range(40)), odd), "all": list(range(40))}, {"odd": 1, "all": 1}, seed=0)
    ckpt, _ = saved_after(tmp_path, source, steps=2)
    status, out, err = run_cli("samples", ckpt, "--consumed")
    assert status == 4 and "(item " in out
    assert "it is a Filtered: which items a Filtered keeps depends on its predicate" in err


def long(document: list) -> bool:
    return len(document) > 1


def test_a_packed_filter_saved_before_packers_noted_its_draws_names_pieces_by_kept_item_with_the_reason(tmp_path):
    docs = [[d] * (1 + d % 3) for d in range(60)]  # every token is its document's number
    kept = [d for d, doc in enumerate(docs) if long(doc)]
    ckpt, taken = saved_after(tmp_path, Packed(Filtered(docs, long), 3))
    state = _files.read_loader_state(ckpt, 0, 0)
    for snap in state["stream"]["snapshots"]:  # as a release before it wrote them: (index, document, offset)
        dataset = snap["dataset"]
        assert dataset.pop("mark_width") == 4
        dataset["marks"] = [v for i, v in enumerate(dataset["marks"]) if i % 4 != 3]
    status, out, err = run_cli("samples", save_checkpoint(tmp_path / "old", [[state]]), "--consumed", "--json")
    assert status == 4
    for step, answer in enumerate(json.loads(out)["ranks"][0]["batches"]):
        tokens = [t for row in taken[0][step] for t in row]
        assert [kept[piece["item"]] for piece in answer["pieces"]] == list(dict.fromkeys(tokens))
        assert "between" not in answer
    assert "which items a Filtered keeps depends on its predicate applied to the data, and the checkpoint records " \
           "what a filter drew for each step only where it is the loader's outermost source, or the source of an " \
           "outermost Packed in a checkpoint written since packers note their filter's draws" in err
