"""What ``bench_lm.py`` reads: local JSON-lines sources, the pipelines compared, and the bare generator.

Nothing is downloaded: the sources are written into a temporary folder by :func:`write_sources`.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any, Iterator, Mapping, Optional

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from accelerate_stateful.sources import Mixture, Packed, Shuffled, exact_shuffle

WEIGHTS = {"code": 0.3, "math": 0.1, "web": 0.6}
SEED = 1234
OFFSET = 10_000_000  # row ids: source i's rows are i * OFFSET + n, unique over the mixture

HF = "HF: interleave_datasets + shuffle, own state_dict"
OURS_SHUFFLED = "ours: Shuffled(Mixture(streams))"
OURS_EXACT = "ours: Mixture(exact_shuffle(stream.shuffle()))"
RESUME_PIPELINES = (HF, OURS_SHUFFLED, OURS_EXACT)


# --------------------------------------------------------------------------- sources on disk
def write_sources(folder: str, documents: int, shards: int = 8, seed: int = 0) -> dict[str, list[str]]:
    """``documents`` rows of ``{"id": int}`` split between the sources in proportion to their weights (plus a
    margin, so that the mixture rarely ends on its first exhausted source before ``documents``), each source
    in ``shards`` JSON-lines files. Returns each source's files."""
    os.makedirs(folder, exist_ok=True)
    files: dict[str, list[str]] = {}
    for index, name in enumerate(sorted(WEIGHTS)):
        rows = int(documents * WEIGHTS[name] / sum(WEIGHTS.values()) * 1.2) + 50
        files[name] = []
        per_shard = -(-rows // shards)
        for shard in range(shards):
            path = os.path.join(folder, f"{name}-{shard:02d}.jsonl")
            with open(path, "w", encoding="utf-8") as handle:
                for n in range(shard * per_shard, min(rows, (shard + 1) * per_shard)):
                    handle.write(json.dumps({"id": index * OFFSET + n}) + "\n")
            files[name].append(path)
    return files


def streams(files: Mapping[str, list[str]]) -> dict[str, Any]:
    """Each source as a 🤗 streaming ``IterableDataset`` over its local files."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return {name: datasets.load_dataset("json", data_files=paths, split="train", streaming=True)
            for name, paths in files.items()}


def pipeline(name: str, files: Mapping[str, list[str]], buffer_size: int) -> Any:
    """A fresh pipeline ``name`` over ``files``: a mixture of the sources with a shuffle buffer of ``buffer_size``.

    HF: ``interleave_datasets(probabilities=WEIGHTS)`` then ``.shuffle(buffer_size=...)``, resumed through its
    own ``state_dict()``. Ours: the package's ``Shuffled`` over a ``Mixture`` of the same streams, or a
    ``Mixture`` of the streams each shuffled by ``datasets`` and resumed with ``exact_shuffle``.
    """
    import datasets

    found = streams(files)
    names = sorted(found)
    if name == HF:
        total = sum(WEIGHTS.values())
        mixed = datasets.interleave_datasets([found[n] for n in names],
                                             probabilities=[WEIGHTS[n] / total for n in names], seed=SEED)
        return mixed.shuffle(seed=SEED, buffer_size=buffer_size)
    if name == OURS_SHUFFLED:
        return Shuffled(Mixture(found, WEIGHTS, seed=SEED), buffer_size, seed=SEED)
    if name == OURS_EXACT:
        shuffled = {n: exact_shuffle(found[n].shuffle(seed=SEED, buffer_size=buffer_size)) for n in names}
        return Mixture(shuffled, WEIGHTS, seed=SEED)
    raise ValueError(name)


def read_again(name: str, state: dict) -> Optional[int]:
    """Rows a resume from ``state`` reads again before its first new row (``None``: not known, HF)."""
    if name == OURS_SHUFFLED:
        position = state["position"]
        return 0 if position is None else position["read"] - position["from_read"]
    if name == OURS_EXACT:
        position = state["position"]
        if position is None:
            return 0
        return sum(p["read"] - p["from_read"] for p in position["sources"].values() if isinstance(p, dict))
    return None


# --------------------------------------------------------------------------- per-batch: documents of tokens
def token_documents(documents: int, seed: int = 0, mean_tokens: int = 600) -> dict[str, list[dict]]:
    """In-memory sources of tokenized documents ``{"input_ids": [int, ...]}``, lengths 16 to 2 * mean_tokens."""
    rng = random.Random(seed)
    vocabulary = list(range(200))  # small ints: Python keeps one object each, so the lists stay compact
    out = {}
    for name in sorted(WEIGHTS):
        count = int(documents * WEIGHTS[name] / sum(WEIGHTS.values()) * 1.2) + 10
        out[name] = [{"input_ids": rng.choices(vocabulary, k=rng.randint(16, 2 * mean_tokens))} for _ in range(count)]
    return out


def ours_packed(sources: Mapping[str, list], seq_len: int) -> IterableDataset:
    return Packed(Mixture(sources, WEIGHTS, seed=SEED), seq_len)


class BarePacked(IterableDataset):
    """What ``Packed(Mixture(...))`` does, as a bare generator: weighted draws with ``random.Random``, documents
    laid end to end and cut every ``seq_len`` tokens, the same ``{"input_ids", "position_ids"}`` rows. Not
    resumable. Each ``DataLoader`` worker reads every row and keeps every ``num_workers``-th, as the package's
    sources do (so the rows do not depend on the number of workers)."""

    def __init__(self, sources: Mapping[str, list], seq_len: int) -> None:
        self.sources, self.seq_len = dict(sources), seq_len

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        for k, row in enumerate(self._rows()):
            if k % workers == worker:
                yield row

    def _rows(self) -> Iterator[dict]:
        rng, size = random.Random(SEED), self.seq_len
        names = sorted(self.sources)
        weights = [WEIGHTS[n] for n in names]
        nexts = dict.fromkeys(names, 0)
        tokens, start = np.zeros(0, dtype=np.int64), 0
        while True:
            ids, positions, have = [], [], 0
            while have < size:
                if start == len(tokens):
                    name = rng.choices(names, weights)[0]
                    source, i = self.sources[name], nexts[name]
                    if i >= len(source):
                        return
                    nexts[name] = i + 1
                    tokens, start = np.asarray(source[i]["input_ids"], dtype=np.int64), 0
                    continue
                piece = tokens[start:start + size - have]
                start += len(piece)
                have += len(piece)
                ids.append(piece)
                positions.append(np.arange(len(piece)))
            yield {"input_ids": torch.from_numpy(np.concatenate(ids)),
                   "position_ids": torch.from_numpy(np.concatenate(positions))}
