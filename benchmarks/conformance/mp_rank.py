"""A rank of the 1 -> 2 processes launch: every listed loader resumes its 1-process checkpoint, one after another.

``python mp_rank.py ROOT``: ``ROOT/peers.json`` lists the rows; each writes ``ROOT/<row>/rank<r>.json``, the
ids it trained or the error it raised (a loader's failure is its cell, not the launch's).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent.parent / "tests")]

import mp_harness_rank  # noqa: E402

from cells import failure, quiet  # noqa: E402
from peers import PEERS  # noqa: E402
from peers_torch import world  # noqa: E402
from scenarios import BY_KEY  # noqa: E402


def main(root: Path) -> None:
    quiet()
    rows = json.loads((root / "peers.json").read_text())
    scenario = BY_KEY["1-to-2"]
    for index in rows:
        peer = PEERS[index]
        try:
            result = {"trained": peer.segment(scenario, root / str(index), 1, None)}
        except Exception as exc:  # this loader's cell
            result = failure(exc)
        (root / str(index) / f"rank{world()[0]}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    mp_harness_rank.run(main, Path(sys.argv[1]))
