"""What each rank trained on, step by step, for ``accelerate-stateful check-resume``.

The checker switches recording on through the environment (``ACCELERATE_STATEFUL_RECORD=<folder>``); the
training script has no code for it. Unset, nothing is installed: each hook point costs one ``is None`` test.
Each rank appends JSON lines to ``<folder>/rank<r>.jsonl``, flushed at every optimizer step, so a killed run
leaves what it recorded up to the kill:

- ``start``: an ``Accelerator`` was made (one per process start);
- ``step``: after a step of the first prepared optimizer: the step number, each batch that prepared loaders
  handed out since the previous step for training (a batch handed out while a prepared model is in ``eval()``
  mode is an evaluation's: counted as ``evaluation_batches``, not compared) (a digest of its tensors' bytes, a short look at its first values, and a
  short digest of each of its samples: row ``i`` of every tensor), the hash chain of every batch of the run so
  far, each loss ``accelerator.backward`` saw, and a digest of the prepared models' parameters after the step
  with their norm (compared within a tolerance when the process count changes between resumes);
- ``saving``: ``save_state`` wrote Accelerate's files into its folder, and goes on with the loaders' positions
  and the seal: the checkpoint holds the run as of this step;
- ``held``: the process reached the checker's kill point and stopped itself (``_record_switch.HOLD_ENV``);
- ``backward``: ``accelerator.backward`` was called (``n``: its count in the step being made), and ``eval``: an
  evaluation batch was handed out (a prepared model was in ``eval()`` mode; once per step), so ``check-resume``
  can name these moments as kill points; each ``step`` line also has the training loader's ``epoch``;
- ``resumed``: a checkpoint was loaded; the steps that follow continue from the step it was saved at.

The step a checkpoint was saved at is read back from the ``saving`` lines of the runs before (the folder is
the same for a whole chain of resumes), so the checkpoint itself holds nothing of the recording.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, Optional

import torch

from . import _record_switch
from ._record_switch import HOLD_ENV, RECORD_ENV, parse_line, reaches


def start(accelerator: Any) -> None:
    """Start recording for ``accelerator``'s rank if the checker asked for it (``ACCELERATE_STATEFUL_RECORD``)."""
    folder = os.environ.get(RECORD_ENV)
    _record_switch.active = Recorder(Path(folder), accelerator) if folder else None


def _hash(*parts: bytes) -> str:
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(part)
    return h.hexdigest()


def _feed(h: Any, value: Any) -> None:
    """Feed ``value`` (tensors, mappings, sequences, plain values) to the hash ``h``, structure included."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(value.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    elif isinstance(value, Mapping):
        h.update(b"{")
        for key in sorted(value, key=str):
            h.update(repr(key).encode())
            _feed(h, value[key])
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update(b"[")
        for item in value:
            _feed(h, item)
        h.update(b"]")
    else:
        h.update(repr(value).encode())


def batch_digest(batch: Any) -> str:
    """A short digest of ``batch``'s bytes: equal batches, equal digests."""
    h = hashlib.blake2b(digest_size=8)
    _feed(h, batch)
    return h.hexdigest()


def sample_digests(batch: Any) -> list[str]:
    """A 6-byte digest of each sample of ``batch``: row ``i`` of each tensor whose first dimension is the batch's
    (the first tensor's), so the same sample gives the same digest whichever rank's batch it is in."""
    found = _first_tensor(batch, "", integer=False)
    if found is None or found[1].dim() == 0:
        return []
    rows = found[1].shape[0]
    digests = []
    for i in range(rows):
        h = hashlib.blake2b(digest_size=6)
        _feed(h, _row(batch, i, rows))
        digests.append(h.hexdigest())
    return digests


def _row(value: Any, i: int, rows: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value[i] if value.dim() and value.shape[0] == rows else value
    if isinstance(value, Mapping):
        return {key: _row(item, i, rows) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_row(item, i, rows) for item in value]
    return value


def peek(batch: Any, values: int = 6) -> str:
    """The first values of the batch's first tensor (an integer one if any: ids, tokens), e.g. ``id [3, 17, 8]``."""
    found = _first_tensor(batch, "", integer=True) or _first_tensor(batch, "", integer=False)
    if found is None:
        return ""
    name, tensor = found
    flat = tensor.detach().reshape(-1)[:values].cpu().tolist()
    shown = [round(v, 4) if isinstance(v, float) else v for v in flat]
    more = ", ..." if tensor.numel() > values else ""
    return f"{name + ' ' if name else ''}[{', '.join(map(str, shown))}{more}]"


def _first_tensor(value: Any, name: str, integer: bool) -> Optional[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        fits = not (value.is_floating_point() or value.is_complex()) or not integer
        return (name, value) if fits and value.numel() else None
    if isinstance(value, Mapping):
        items: Any = value.items()
    else:
        items = enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, item in items:
        found = _first_tensor(item, str(key) if isinstance(value, Mapping) else name, integer)
        if found is not None:
            return found
    return None


def _loss_value(loss: Any) -> Any:
    if isinstance(loss, torch.Tensor):
        return loss.detach().double().sum().item()
    return float(loss)


class Recorder:
    """One rank's record file, and what the current step has seen so far."""

    def __init__(self, folder: Path, accelerator: Any) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"rank{accelerator.process_index}.jsonl"
        self._accelerator = weakref.ref(accelerator)  # recording never keeps a run's objects alive
        self._file: IO[str] = self.path.open("a", encoding="utf-8")
        if _ends_cut(self.path):  # a kill cut the last line short: the next record starts on its own line
            self._file.write("\n")
        self._watching = False  # the first prepared optimizer's steps are recorded
        self.step, self.chain = 0, ""
        self._epoch: Optional[int] = None  # the training loader's, at its last batch
        self._evaluated = False  # an evaluation batch since the last step
        self._evaluations = 0  # evaluation batches since the last step (counted, not compared)
        self._batches: list = []
        self._losses: list = []
        hold = os.environ.get(HOLD_ENV)
        self._hold: Optional[dict] = json.loads(hold) if hold and hasattr(signal, "SIGSTOP") else None
        self._write({"event": "start", "pid": os.getpid(), "time": time.time()})

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()  # a SIGKILL keeps what reached the OS; no fsync: the machine does not crash
        if self._hold is not None and reaches(self._hold, record):
            self._hold = None  # once: a run the checker sends SIGTERM and SIGCONT goes on to its own end
            self._file.write(json.dumps({"event": "held", "step": self.step, "time": time.time()}) + "\n")
            self._file.flush()
            os.kill(os.getpid(), signal.SIGSTOP)  # the checker signals the run now: the kill lands here

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Record at the steps of ``optimizer`` if it is the first prepared one.

        An instance hook, registered at prepare: it runs before the hooks added later (a preemption checkpoint
        taken at the end of the same step), so the step is on record before any save that follows it.
        """
        if not self._watching:
            self._watching = True
            optimizer.register_step_post_hook(self._stepped)

    def batch(self, batch: Any, loader: Any = None) -> None:
        accelerator = self._accelerator()
        if accelerator is not None and any(not m.training for m in accelerator._models):
            # An evaluation batch: not trained on, so not part of the step's batches or the chain (a run resumed
            # from a checkpoint saved after an evaluation does not evaluate again, and need not).
            if not self._evaluated:
                self._evaluated = True
                self._write({"event": "eval", "step": self.step})
            self._evaluations += 1
            return
        if loader is not None:
            self._epoch = getattr(loader, "epoch", None)
        digest = batch_digest(batch)
        self.chain = _hash(self.chain.encode(), digest.encode())
        self._batches.append([digest, peek(batch), sample_digests(batch)])

    def loss(self, loss: Any) -> None:
        self._losses.append(_loss_value(loss))
        self._write({"event": "backward", "step": self.step + 1, "n": len(self._losses)})

    def _stepped(self, *_: Any) -> None:
        self.step += 1
        self._write({"event": "step", "step": self.step, "epoch": self._epoch, "batches": self._batches,
                     "chain": self.chain, "losses": self._losses, **self._params(), "time": time.time(),
                     **({"evaluation_batches": self._evaluations} if self._evaluations else {})})
        self._evaluated, self._evaluations = False, 0
        self._batches, self._losses = [], []

    def _params(self) -> dict:
        accelerator = self._accelerator()
        h = hashlib.blake2b(digest_size=8)
        squares = 0.0
        for model in accelerator._models if accelerator is not None else []:
            for name, param in model.named_parameters():
                h.update(name.encode())
                _feed(h, param)
                squares += param.detach().double().pow(2).sum().item()
        return {"params": h.hexdigest(), "norm": squares ** 0.5}

    def saving(self, checkpoint: Path) -> None:
        """``save_state`` writes ``checkpoint``: it holds the run as of the last recorded step."""
        self._write({"event": "saving", "checkpoint": str(Path(checkpoint).resolve()), "step": self.step,
                     "chain": self.chain})

    def resumed(self, checkpoint: Path) -> None:
        """A checkpoint was loaded: continue from the step, and the chain, it was saved at."""
        path = str(Path(checkpoint).resolve())
        saved = _saved_at(self.path.parent, self.path, path)
        self.step, self.chain = (saved["step"], saved["chain"]) if saved else (0, "")
        self._batches, self._losses = [], []
        self._write({"event": "resumed", "checkpoint": path, "step": saved["step"] if saved else None,
                     "time": time.time()})


def _ends_cut(path: Path) -> bool:
    with path.open("rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def _saved_at(folder: Path, own: Path, checkpoint: str) -> Optional[dict]:
    """The last ``saving`` line for ``checkpoint``: in this rank's file, else in another rank's (a rank the run
    did not have before it was resumed on more processes); ``None`` if it was saved unrecorded."""
    for path in [own] + sorted(p for p in folder.glob("rank*.jsonl") if p != own):
        found = None
        for line in path.read_text("utf-8").splitlines() if path.exists() else []:
            record = parse_line(line)
            if record and record.get("event") == "saving" and record.get("checkpoint") == checkpoint:
                found = record
        if found is not None:
            return found if path == own else {**found, "chain": ""}
    return None
