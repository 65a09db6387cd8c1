"""Loader positions inside a ``torch.distributed.checkpoint`` (DCP) checkpoint.

For training scripts that checkpoint with ``dcp.save`` / ``dcp.load`` (torchtitan
style) instead of ``accelerator.save_state``. DCP loads *in place*: it asks each
``Stateful`` for its ``state_dict()``, fills the tensors it finds there from the
checkpoint and hands the dict back to ``load_state_dict()``. Three of its habits
shape this module:

- a key of the checkpoint that the local state lacks is silently dropped, so the
  local state must have its full shape before the first batch;
- a tensor must have the same shape at save and at load, so a loader state (a
  tree whose shape changes as iteration goes on) is stored as a uint8 buffer of a
  capacity fixed at construction;
- a non-tensor value is stored with ``torch.save`` and read back with
  ``torch.load(weights_only=False)``, i.e. unpickled, so only tensors are stored.

Each buffer holds a header and :func:`accelerate_stateful.checkpoint._files.encode`'s JSON
and safetensors encoding of one loader's state; nothing is unpickled to read it.
Each rank's buffers sit under a key of their own, so ranks never overwrite each
other (DCP keeps one copy of a key that several ranks write).
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch.distributed.checkpoint.stateful import Stateful

from . import _files
from . import _in_step
from ._checkpoints import agree
from ..loaders import _putback
from ..loaders._adapter import DataLoaderAdapter
from ._versions import refuse_unknown_version
from ..errors import CheckpointError, Mismatch, StateMismatchError, StateSerializationError
from ..loaders.skip import SkipDataLoader

DEFAULT_CAPACITY = 64 * 1024
ENVELOPE_VERSION = 1
SUPPORTED_ENVELOPE_VERSIONS = (1,)
_MAGIC = b"ASDCP\x00\x00\x01"
# magic, nonce of the state_dict() call that made the buffer, JSON length, safetensors length
_HEADER = struct.Struct("<8s8sQQ")

LoaderLike = Union[DataLoaderAdapter, SkipDataLoader]


class LoaderCheckpoint(Stateful):
    """The positions of prepared loaders, as a ``Stateful`` that ``dcp.save`` / ``dcp.load`` handle safely.

    ``state_dict()`` has the same keys, dtypes and shapes in every lifecycle
    state of the loaders, so a template taken before the first batch receives
    everything a checkpoint taken mid-epoch holds. ``load_state_dict()`` checks
    every buffer (structure, header, rank, world size, number of loaders, and
    each loader's own validation) before it loads any loader, so a load is
    whole or refused.

    Args:
        loaders: One prepared loader or a sequence of them (``SkipDataLoader``
            views included), in the same order at save and at load.
        rank: The rank whose key the buffers go under; defaults to the loaders'
            rank. Pass the data-parallel rank where several ranks share one (tensor
            parallelism): those ranks hold the same position and DCP keeps one copy.
        capacity: Bytes per loader buffer; must be the same at save and at load.
        name: The key this object is stored under in the DCP state, for messages.

    State dict:
        rank_<r>: ``{"loader_<i>": uint8 tensor of capacity bytes}``, one buffer per loader.

    Examples:
        >>> import torch.distributed.checkpoint as dcp                       # doctest: +SKIP
        >>> state = {"model": model_state, "dataloader": LoaderCheckpoint(train_dl)}
        >>> dcp.save(state, checkpoint_id="ckpt/step_100")                   # doctest: +SKIP
        >>> dcp.load(state, checkpoint_id="ckpt/step_100")                   # doctest: +SKIP
    """

    def __init__(
        self,
        loaders: Union[LoaderLike, Sequence[LoaderLike]],
        *,
        rank: Optional[int] = None,
        capacity: int = DEFAULT_CAPACITY,
        name: str = "dataloader",
    ) -> None:
        loaders = list(loaders) if isinstance(loaders, (list, tuple)) else [loaders]
        if not loaders:
            raise ValueError("LoaderCheckpoint needs at least one prepared loader")
        self._loaders = [_adapter_of(loader, i) for i, loader in enumerate(loaders)]
        contexts = {(dl.ctx.rank, dl.ctx.world_size) for dl in self._loaders}
        if len(contexts) > 1:
            raise ValueError(f"the loaders were prepared for different ranks or world sizes: {sorted(contexts)}")
        ctx = self._loaders[0].ctx
        self.rank = ctx.rank if rank is None else int(rank)
        self.world_size = ctx.world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} is not a rank of a world of {self.world_size} processes")
        if capacity < _HEADER.size + 64:
            raise ValueError(f"capacity={capacity} is too small for a loader state; use the default {DEFAULT_CAPACITY}")
        self.capacity = int(capacity)
        self.name = name
        self._nonce = b""

    # ----------------------------------------------------------------- Stateful
    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{"rank_<r>": {"loader_<i>": buffer}}``; the same keys and shapes in every lifecycle state.

        ``dcp.save``/``dcp.load`` call it on every rank: there every rank's loaders must be at the same point
        (``_in_step``), or every rank refuses.
        """
        ctx = self._loaders[0].ctx
        _in_step.settle(ctx, self._loaders, "dcp.save/dcp.load of LoaderCheckpoint")
        self._nonce = os.urandom(8)
        # A state too large on one rank is refused on every rank, so none goes on into DCP's collectives alone.
        buffers = agree(ctx, lambda: {
            f"loader_{i}": self._pack(i, state) for i, state in
            enumerate(_putback.checkpoint_states(ctx, self._loaders, "dcp.save of LoaderCheckpoint"))
        })
        return {self._rank_key: buffers}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Check every buffer, then restore every loader; refuses anything partial, foreign or damaged.

        Call it on every rank (``dcp.load`` does): a refusal on one rank raises the same error on every rank,
        naming the rank and why, as ``accelerator.load_state()`` does.
        """
        ctx = self._loaders[0].ctx
        states = agree(ctx, lambda: self._checked_states(state_dict))
        _in_step.settle(ctx, self._loaders, "LoaderCheckpoint.load_state_dict()")
        _in_step.refuse_live(ctx, self._loaders, "LoaderCheckpoint.load_state_dict()")

        def restore() -> None:
            for loader, state in zip(self._loaders, states):
                loader.load_state_dict(state)

        agree(ctx, restore)

    def _checked_states(self, state_dict: Mapping[str, Any]) -> list[Any]:
        """Every loader's state from this rank's buffers, each validated against its loader."""
        buffers = self._check_structure(state_dict)
        states = []
        for i, loader in enumerate(self._loaders):
            state = self._unpack(i, buffers[f"loader_{i}"])
            loader.validate_state(state, source=self._where(i))
            states.append(state)
        return states

    # ----------------------------------------------------------------- encoding
    @property
    def _rank_key(self) -> str:
        return f"rank_{self.rank}"

    def _where(self, index: int) -> str:
        return f"DCP entry '{self.name}.{self._rank_key}.loader_{index}'"

    def _pack(self, index: int, state: Any) -> torch.Tensor:
        envelope = {
            "envelope_version": ENVELOPE_VERSION,
            "rank": self.rank,
            "world_size": self.world_size,
            "loader": index,
            "num_loaders": len(self._loaders),
            "state": None,
        }
        tree, tensors = _files.encode(state)
        envelope["state"] = tree
        text = json.dumps(envelope, sort_keys=True, allow_nan=False).encode()
        tensor_bytes = st_save(tensors) if tensors else b""
        payload = _HEADER.pack(_MAGIC, self._nonce, len(text), len(tensor_bytes)) + text + tensor_bytes
        if len(payload) > self.capacity:
            suggested = 1 << (2 * len(payload) - 1).bit_length()
            raise StateSerializationError(
                f"the state of loader {index} on rank {self.rank} takes {len(payload)} bytes, more than "
                f"capacity={self.capacity}; pass LoaderCheckpoint(..., capacity={suggested}) when saving and when "
                "loading",
                path=f"{self._rank_key}/loader_{index}",
            )
        buffer = torch.zeros(self.capacity, dtype=torch.uint8)
        buffer[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return buffer

    def _check_structure(self, state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
        """This rank's buffers, once the loaded dict is known to have exactly the local structure."""
        expected = {self._rank_key: sorted(f"loader_{i}" for i in range(len(self._loaders)))}
        if _structure(state_dict) != expected:
            raise StateMismatchError(
                [Mismatch("structure", _structure(state_dict), expected)],
                fix="load the dict this object's state_dict() returned, filled by dcp.load, with the same loaders "
                "in the same order as the run that saved it",
                source=f"DCP entry '{self.name}'",
            )
        buffers = state_dict[self._rank_key]
        for i in range(len(self._loaders)):
            value = buffers[f"loader_{i}"]
            if not (isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.shape == (self.capacity,)):
                saved = f"{value.dtype} tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) \
                    else type(value).__name__
                raise StateMismatchError(
                    [Mismatch("buffer", saved, f"torch.uint8 tensor of shape ({self.capacity},)")],
                    fix=f"pass the same capacity as the run that saved it (capacity={self.capacity} here)",
                    source=self._where(i),
                )
        return buffers

    def _unpack(self, index: int, buffer: torch.Tensor) -> Any:
        where = self._where(index)
        raw = buffer.detach().cpu().contiguous().numpy().tobytes()
        magic, nonce, text_len, tensor_len = _HEADER.unpack_from(raw)
        if magic != _MAGIC:
            raise CheckpointError(
                f"{where} is not a loader buffer written by LoaderCheckpoint (its header is {magic!r}); the "
                "checkpoint is damaged or holds something else under this key, resume from another checkpoint"
            )
        if nonce == self._nonce:
            raise CheckpointError(
                f"{where} was not filled by the load: it still holds what state_dict() produced for it (the "
                "checkpoint lacks this key, or a planner with allow_partial_load=True skipped it); load a "
                "checkpoint saved with this LoaderCheckpoint on the same number of processes"
            )
        end = _HEADER.size + text_len + tensor_len
        if end > self.capacity:
            raise CheckpointError(
                f"{where} claims {text_len} + {tensor_len} bytes of state, more than its capacity of "
                f"{self.capacity}; the checkpoint is damaged, resume from another checkpoint"
            )
        try:
            text = raw[_HEADER.size:_HEADER.size + text_len].decode("utf-8")
            envelope = json.loads(text, parse_constant=_files._reject_constant)
            tensors = st_load(raw[_HEADER.size + text_len:end]) if tensor_len else {}
        except Exception as exc:  # UnicodeDecodeError, JSONDecodeError, safetensors' own SafetensorError
            raise CheckpointError(
                f"{where} does not hold a valid loader state ({type(exc).__name__}: {exc}); the checkpoint is "
                "damaged, resume from another checkpoint"
            ) from None
        if not isinstance(envelope, dict) or "state" not in envelope:
            raise CheckpointError(
                f"{where} holds JSON that is not a loader envelope; the checkpoint is damaged, resume from another "
                "checkpoint"
            )
        self._check_envelope(index, envelope)
        return _files.decode(envelope["state"], tensors, where)

    def _check_envelope(self, index: int, envelope: Mapping[str, Any]) -> None:
        refuse_unknown_version("envelope_version", envelope.get("envelope_version"), SUPPORTED_ENVELOPE_VERSIONS,
                               self._where(index))
        current = {
            "rank": self.rank,
            "world_size": self.world_size,
            "loader": index,
            "num_loaders": len(self._loaders),
        }
        mismatches = [Mismatch(k, envelope.get(k), v) for k, v in current.items() if envelope.get(k) != v]
        if mismatches:
            raise StateMismatchError(
                mismatches,
                fix="load it on the same number of processes with the same loaders in the same order (use "
                "accelerator.save_state() for a checkpoint that may resume on another number of processes)",
                source=self._where(index),
            )


def _structure(value: Any) -> Any:
    """The keys of a two-level dict (leaves by type name), to compare and to print."""
    if not isinstance(value, Mapping):
        return type(value).__name__
    return {k: sorted(str(n) for n in v) if isinstance(v, Mapping) else type(v).__name__ for k, v in value.items()}


def _adapter_of(loader: Any, index: int) -> DataLoaderAdapter:
    if isinstance(loader, SkipDataLoader):
        return loader.loader
    if isinstance(loader, DataLoaderAdapter):
        return loader
    raise TypeError(
        f"loader {index} is a {type(loader).__name__}; LoaderCheckpoint takes loaders returned by "
        "accelerator.prepare() (or built with ShardDataLoader.from_dataloader() and friends)"
    )
