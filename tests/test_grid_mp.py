"""One chain of the elastic grid (issue 28 §4) in the suite; ``make soak`` runs all 52 (``tests/grid.py``).

The issue's pipeline, ``Packed(Mixture(Filtered(exact_shuffle(🤗 stream)), StreamingDataset, table))``, trained
in 6 launches on 1, 2, 2, 4, 3 and 1 processes with 0, 1, 1, 2, 4 and 2 workers, each saving and stopping a
few steps in, the last running to the end of the data. Required (``grid.check_chain``): the first launch is
the uninterrupted run; the resume on the cell it was saved on repeats row for row what its predecessor
trained past the save; over the chain every source delivers its documents in its own order, each token once.
"""

from __future__ import annotations

import itertools

import pytest

import grid

pytest.importorskip("streaming")


def test_the_grid_plan_covers_every_ordered_pair_of_cells_and_each_cell_on_itself_in_chains_of_5_resumes():
    chains = grid.plan()
    transitions = [(chain[i], chain[i + 1]) for chain in chains for i in range(grid.DEPTH)]
    assert len(grid.CELLS) == 16 and all(len(chain) == grid.DEPTH + 1 for chain in chains)
    assert set(transitions) == set(itertools.product(grid.CELLS, grid.CELLS))  # 240 changes, 16 on itself
    assert len(chains) == 52 and len({(depth, chain[depth]) for chain in chains for depth in range(6)}) == 91
    # Every launch saves before the data runs out (42 batches of the base loader) and after the last resume.
    for number, chain in enumerate(chains + [grid.CI_CHAIN]):
        stops = grid.stops(number, chain)
        assert stops[:-1] == sorted(set(stops[:-1])) and stops[-1] == -1
        assert sum(grid.advance(number, d, world) * world for d, (world, _) in enumerate(chain[:-1])) <= 30


def test_the_grid_check_finds_a_token_repeated_or_lost(tmp_path):
    grid.mp_grid.write_data(tmp_path)
    rows = grid.uninterrupted(tmp_path, 1, grid.mp_grid.pipeline(tmp_path))
    assert grid.source_problems(tmp_path, rows, len(rows)) == []
    assert grid.source_problems(tmp_path, rows[:5] + rows[4:], 10) != []  # row 4 twice
    assert grid.source_problems(tmp_path, rows[:4] + rows[5:], 10) != []  # row 4 lost


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_pipeline_resumed_on_every_process_and_worker_count_in_one_chain_loses_and_repeats_nothing(tmp_path):
    chains = {0: grid.CI_CHAIN}
    results = grid.run(tmp_path, chains, timeout_s=240, log=lambda line: None)
    failed = [result for result in results if not result["ok"]]
    assert not failed, "\n".join((tmp_path / "launches" / r["folder"] / "report.txt").read_text() for r in failed)
    problems, figures = grid.check(tmp_path, chains)
    assert not problems, "\n".join(problems)
    assert figures == {"chains": 1, "chains_passed": 1, "changes_covered": 4, "same_topology_covered": 1,
                       "changes_passed": 4, "same_topology_passed": 1}
