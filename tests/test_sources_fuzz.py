"""A few cases of ``tests/sources_fuzz.py`` (random composable pipelines through random chains of topologies)
in the suite, so it keeps working; ``make soak`` runs 300."""

from __future__ import annotations

import io

from accelerate_stateful import IterableShardDataLoader

from sources_fuzz import check, draw_case, run_cases


def test_a_few_random_pipelines_resume_through_random_topology_chains_exactly():
    out = io.StringIO()
    failed, refused = run_cases(6, seed=0, workers=False, out=out)
    assert failed == 0, out.getvalue()
    assert refused < 6  # the cases drawn are not all refusals


def test_the_check_fails_a_resume_that_ignores_the_checkpoint(monkeypatch):
    """The checker is not blind: a resume that starts the epoch again repeats what was taken."""
    spec = dict(draw_case(3)[0], drop_last=False, split=False)
    chain = [(2, 0, 4, None), (1, 0, None, None)]
    assert check(spec, chain) == []
    monkeypatch.setattr(IterableShardDataLoader, "load_state_dict", lambda self, state: None)
    assert any("repeated" in problem for problem in check(spec, chain))
