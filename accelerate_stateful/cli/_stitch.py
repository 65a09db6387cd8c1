"""The records of ``check-resume``: read as the runs append them, stitched across resumes, compared.

Pure reading and comparing (no torch): the records are the JSON lines ``training/_record.py`` writes. The
checker reads each rank's file as a run appends to it, so it knows which run wrote each line. Stitching a chain
of runs keeps, for each step number, the record of the last run that reached it: a run that resumed from the
checkpoint of step ``c`` records steps ``c + 1, ...`` again, replacing what the killed run recorded after its
checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..training._record_switch import parse_line


class RecordFiles:
    """Each rank's record file in one folder, read from where the previous :meth:`take` stopped."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._offsets: dict[Path, int] = {}

    def take(self) -> dict[int, list[dict]]:
        """The complete lines appended since the last call, parsed, per rank (a line being written waits)."""
        found: dict[int, list[dict]] = {}
        for path in sorted(self.folder.glob("rank*.jsonl")):
            with path.open("rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1
            self._offsets[path] = self._offsets.get(path, 0) + end
            lines = [parse_line(line) for line in data[:end].decode("utf-8", "replace").splitlines()]
            found[int(path.stem[len("rank"):])] = [r for r in lines if r is not None]
        return found


def last_step(records: dict[int, list[dict]]) -> Optional[int]:
    """The highest step number among ``records`` (one run's new lines), or ``None`` if none is a step."""
    steps = [r["step"] for lines in records.values() for r in lines if r.get("event") == "step"]
    return max(steps) if steps else None


@dataclass
class Stitched:
    """One rank's chain of runs: each step's record, tagged with the index of the run that made it."""

    steps: dict[int, dict] = field(default_factory=dict)


def stitch(runs: list[dict[int, list[dict]]]) -> dict[int, Stitched]:
    """Each rank's stitched chain, from each run's lines per rank (in run order)."""
    ranks: dict[int, Stitched] = {}
    for index, lines_by_rank in enumerate(runs):
        for rank, lines in lines_by_rank.items():
            chain = ranks.setdefault(rank, Stitched())
            for record in lines:
                if record.get("event") == "step":
                    step = record["step"]
                    for later in [s for s in chain.steps if s >= step]:
                        del chain.steps[later]  # redone by this run, from the checkpoint it resumed
                    chain.steps[step] = {**record, "run": index}
    return ranks


@dataclass(frozen=True)
class Verdict:
    """The comparison's outcome: ``identical``, ``weights`` (samples identical) or ``samples``.

    ``run`` is the index of the run that recorded the first divergent step (0: the first run of the chain, before
    any kill). ``expected`` and ``came`` say, in words, what the uninterrupted run had and what the chain had.
    """

    kind: str
    steps: int
    step: Optional[int] = None
    rank: Optional[int] = None
    run: Optional[int] = None
    expected: list = field(default_factory=list)
    came: list = field(default_factory=list)
    note: str = ""  # what was compared, where it is not everything bitwise


def compare(reference: dict[int, Stitched], chain: dict[int, Stitched]) -> Verdict:
    """The first step where the chain differs from the uninterrupted run: samples first, then loss and weights."""
    total = max((max(s.steps, default=0) for s in reference.values()), default=0)
    ranks = sorted(set(reference) | set(chain))
    last = max([total] + [max(s.steps, default=0) for s in chain.values()])
    empty = Stitched()
    for step in range(1, last + 1):
        for rank in ranks:
            found = _samples_differ(reference.get(rank, empty).steps.get(step), chain.get(rank, empty).steps.get(step))
            if found is not None:
                run = chain.get(rank, empty).steps.get(step, {}).get("run", _run_after(chain.get(rank, empty), step))
                return Verdict("samples", total, step, rank, run, *found)
    for step in range(1, last + 1):
        for rank in ranks:
            ref, got = reference[rank].steps[step], chain[rank].steps[step]
            found = _weights_differ(ref, got)
            if found is not None:
                return Verdict("weights", total, step, rank, got["run"], *found)
    return Verdict("identical", total)


def _run_after(chain: Stitched, step: int) -> Optional[int]:
    """For a step the chain lacks: the run that recorded the step before it (the run that stopped short)."""
    earlier = [s for s in chain.steps if s < step]
    return chain.steps[max(earlier)]["run"] if earlier else None


def _describe(batches: list, index: int) -> str:
    digest, peek = batches[index][:2]
    return f"batch {index + 1} of the step: {peek or 'no tensor'} (digest {digest})"


def _samples_differ(ref: Optional[dict], got: Optional[dict]) -> Optional[tuple[list, list]]:
    if ref is None and got is None:
        return None
    if got is None:
        return [f"step {ref['step']} with {len(ref['batches'])} batch(es)"], ["no such step: the run ended before it"]
    if ref is None:
        return ["the run to end before this step"], [f"step {got['step']} with {len(got['batches'])} batch(es)"]
    a, b = ref["batches"], got["batches"]
    for index in range(min(len(a), len(b))):
        if a[index][0] != b[index][0]:
            return [_describe(a, index)], [_describe(b, index)]
    if len(a) != len(b):
        return [_count(a, len(b))], [_count(b, len(a))]
    return None


def _count(batches: list, other: int) -> str:
    """How many batches the step had, and the first one the other side lacks."""
    if len(batches) <= other:
        return f"{len(batches)} batch(es) in the step"
    return f"{len(batches)} batch(es) in the step, the first one more being {_describe(batches, other)}"


def _weights_differ(ref: dict, got: dict) -> Optional[tuple[list, list]]:
    expected, came = [], []
    if ref["losses"] != got["losses"]:
        expected.append(f"loss {_losses(ref)}")
        came.append(f"loss {_losses(got)}")
    if ref["params"] != got["params"]:
        expected.append(f"parameters after the step: digest {ref['params']}")
        came.append(f"parameters after the step: digest {got['params']}")
    return (expected, came) if expected else None


def _losses(record: dict) -> str:
    return ", ".join(repr(v) for v in record["losses"]) or "none (no accelerator.backward in the step)"
