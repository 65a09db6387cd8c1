"""One chain of the elastic grid (issue 28 §4) in the suite; ``make soak`` runs all 52 (``tests/grid.py``).

The issue's pipeline, ``Packed(Mixture(Filtered(exact_shuffle(🤗 stream)), StreamingDataset, table))``, trained
in 6 launches on 1, 2, 2, 4, 3 and 1 processes with 0, 1, 1, 2, 4 and 2 workers, each saving and stopping a
few steps in, the last running to the end of the data. Required (``grid.check_chain``): the first launch is
the uninterrupted run; the resume on the cell it was saved on repeats row for row what its predecessor
trained past the save; over the chain every source delivers its documents in its own order, each token once.
"""

from __future__ import annotations

import pytest

import grid

pytest.importorskip("streaming")


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
