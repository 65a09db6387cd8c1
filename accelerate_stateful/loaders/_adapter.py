"""DataLoaderAdapter: holds a base loader, owns the lifecycle and the state template."""

from __future__ import annotations

import weakref
from typing import Any, Callable, ClassVar, Iterator, Mapping, Optional, Sequence

import torch
from accelerate.state import GradientState
from accelerate.utils import send_to_device
from torch import Tensor  # by name: CPython specialises no attribute read of a module with __getattr__ (torch)
from torch.utils.data import DataLoader

from ..checkpoint import _state as S
from ..checkpoint import _compare, _refusals
from .._context import DistContext
from . import _carried
from ._lifecycle import Lifecycle
from ._passes import PASS, PassHandle, Phase, check_entry
from ._torch_iter import batches_of
from ._forking import warn_if_unsafe
from ._workers import shut_down, track
from ..errors import LifecycleError, Mismatch, UnsupportedConfigError


class DataLoaderAdapter:
    """A prepared loader: wraps a base ``DataLoader`` by composition.

    It is a ``torch.distributed.checkpoint`` ``Stateful`` by its methods (the protocol is structural), without
    importing that package, which costs every process about 2 s at start (``torch.distributed.tensor``).

    The adapter owns the lifecycle (``_lifecycle``) and the public ``state_dict()`` /
    ``load_state_dict()`` (version, validation, lifecycle checks); a variant
    implements the position hooks (``_batches``, ``_position_state``,
    ``_restore``, ``_rewind``, ``_seek``, ``_config``) and ``__len__``.

    Lifecycle:

    ============  ======================  ===========================  ====================
    state         ``iter()``              ``state_dict()``             ``load_state_dict()``
    ============  ======================  ===========================  ====================
    not started   start epoch ``epoch``   start of epoch ``epoch``     allowed → restored
    iterating     end it, see below       after the last batch taken   error while live
    exhausted     start epoch ``epoch``   start of epoch ``epoch``     allowed → restored
    restored      continue from there     the restored position        allowed (replaces)
    ============  ======================  ===========================  ====================

    When a pass hands out its epoch's last batch the epoch is over: ``state_dict()`` is then the start
    of the next epoch. A pass dropped before its end is undone, or ends its epoch if the model was
    trained on it; the verdict follows program order, never the garbage collector (``_lifecycle``).
    """

    _epoch_set = False  # whether the program called set_epoch() in this process

    mode: ClassVar[str] = "abstract"

    def __init__(
        self,
        base_loader: DataLoader,
        ctx: DistContext,
        *,
        seed: int,
        seed_source: str,
        device: Optional[torch.device] = None,
        non_blocking: bool = False,
    ) -> None:
        self._base = base_loader
        self.ctx = ctx
        self.device = device
        self.non_blocking = non_blocking
        self._seed = seed
        self._seed_source = seed_source
        self._epoch = 0
        self._life = Lifecycle(self)
        self._base_iter: Optional[weakref.ref] = None
        # The live pass's base iterator (its workers inside) until the pass's verdict: a pass the loop let go keeps
        # its workers, and so the position a query or a save reads, until the loader's next event (``_end``).
        self._live_base: Any = None
        self.end_of_dataloader = False
        self.remainder = -1
        # Set here, not as class defaults: CPython specialises no read of an instance attribute that shadows a
        # class attribute, and ``_activate`` reads both at every batch.
        self._gradient_state: Optional[GradientState] = None  # the live pass's (``_begin``)
        self._weak_self: Optional["weakref.ref[DataLoaderAdapter]"] = None  # its reference to this loader (``_begin``)
        warn_if_unsafe(base_loader, ctx.world_size)

    # ----------------------------------------------------------------- public surface
    @property
    def epoch(self) -> int:
        """The epoch of the batches the live pass hands out; between passes, the epoch the next pass reads.

        A pure read, like every other query of a loader (``phase``, ``batches_yielded``, ``len``, ``repr``,
        ``state_dict()``): a pass the loop let go is judged at the loader's next event, never by a query. After
        a resume from a checkpoint taken right after an epoch's last batch, this is that finished epoch: the
        next pass is its empty rest (``docs/lifecycle.md``).
        """
        return self._resume_point()[0]

    @property
    def phase(self) -> Phase:
        return Phase.ITERATING if self._life.live is not None and self._life.live.begun else self._life.phase

    @property
    def seed(self) -> int:
        """The seed every epoch's order is drawn from."""
        return self._seed

    @property
    def seed_source(self) -> str:
        """``"data_seed"`` or ``"generator"`` (chosen by the user) or ``"drawn"`` (at random, agreed across ranks)."""
        return self._seed_source

    @property
    def batches_yielded(self) -> int:
        """Batches of the current epoch already handed to the training loop (progress bars)."""
        return self._resume_point()[1]

    def _resume_point(self) -> tuple[int, int, bool]:
        """``(epoch, batches taken, between two epochs)`` as the loader reports them, committing nothing."""
        live = self._life.live
        if live is not None and live.complete:
            return live.final[0], live.final[1], False
        boundary = self._life.boundary()
        if boundary is not None and (live is None or self._life.replaying()):  # a re-run peek will be undone
            return boundary[0], boundary[1], True
        return self._epoch, self._batches_taken(), False

    def progress(self) -> Optional[float]:
        """The part of the current epoch already taken, from 0 to 1; ``None`` for a stream without a length."""
        live = self._life.live
        if live is not None and live.complete:
            return 1.0
        return self._progress()

    def _progress(self) -> Optional[float]:
        try:
            return min(self.batches_yielded / len(self), 1.0)
        except (TypeError, ZeroDivisionError):
            return None

    def unwrap(self) -> DataLoader:
        """The base loader this adapter drives."""
        return self._base

    @property
    def dataset(self) -> Any:
        return self._base.dataset

    @property
    def num_workers(self) -> int:
        return self._base.num_workers

    @property
    def collate_fn(self) -> Any:
        return self._base.collate_fn

    @property
    def pin_memory(self) -> bool:
        return self._base.pin_memory

    def __iter__(self) -> PassHandle:
        return self._life.open(self)

    def set_epoch(self, epoch: int) -> None:
        """Move to the start of ``epoch``; with the epoch the position is in, this changes nothing.

        Between two epochs after a resume, the finished one changes nothing (the next pass is its empty
        rest), and the next one moves on to it.
        """
        self._epoch_set = True  # the program numbers the epochs (a stock resume's line then says nothing of it)
        self._life.settle()
        boundary = self._life.boundary()
        if boundary is not None and epoch == boundary[0] and self._life.live is None:
            return
        if epoch == self._epoch:
            if boundary is not None and self._life.live is None:
                self._life.leave_boundary()
            return
        self._refuse_if_live("set_epoch()")
        self._life.leave_boundary()
        self._life.moved()
        self._start_epoch(epoch)

    def _start_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        self._rewind()
        self._life.phase = Phase.NOT_STARTED

    def _end_epoch(self) -> None:
        """The position moves to the start of the next epoch (the lifecycle sets the phase)."""
        self._epoch += 1
        self._rewind()

    def seek(self, num_batches: int) -> None:
        """Position the loader ``num_batches`` into the epoch its next batch belongs to, reading nothing.

        After a resume at an epoch's end that is the next epoch (Accelerate's recipe,
        ``skip_first_batches(dl, step % len(dl))``, at an epoch boundary). A skip to where a resumed
        loader already stands changes nothing.
        """
        self._refuse_if_live("seek()")
        if num_batches < 0:
            raise ValueError(f"cannot skip {num_batches} batches: the count must be >= 0")
        pending = self._life.pending
        if pending is not None and not pending.complete and num_batches == self._batches_taken():
            return
        self._life.leave_boundary()
        self._life.moved()
        self._seek(num_batches)
        self._life.phase = Phase.RESTORED

    def state_dict(self) -> S.LoaderState:
        """The complete position, valid in every lifecycle state (see the class docstring).

        A pure read: a pass the loop let go is judged at the loader's next event (``iter()``, ``set_epoch``,
        ``accelerator.save_state()``/``load_state()``), never here; until then it is recorded as live.
        """
        with self._life.lock:  # a prefetcher thread's next() moves the position and the pass's record together
            state = dict(self._life.pending.saved) if self._life.replaying() else self._raw_state()
            state[PASS] = _carried.entry(self._life)  # always present: a library that loads in place finds every key
        return state  # type: ignore[return-value]

    def _raw_state(self, epoch: Optional[int] = None, position: Optional[dict] = None) -> dict:
        """Where the loader stands (or ``position`` in ``epoch``: a variant's :meth:`_state_before`), without the
        record of a live pass."""
        state = {
            S.VERSION: S.FORMAT_VERSION,
            S.MODE: self.mode,
            S.EPOCH: self._epoch if epoch is None else epoch,
            S.SEED: self._seed,
            S.SEED_SOURCE: self._seed_source,
            S.TOPOLOGY: {"world_size": self.ctx.world_size, "rank": self.ctx.rank, "num_workers": self.num_workers},
            S.CONFIG: self._config(),
            S.BASE: self._base_state(),
        }
        state.update(self._position_state() if position is None else position)
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a position saved by ``state_dict()``; refused while an iterator is live."""
        self._refuse_if_live("load_state_dict()")
        self.validate_state(state_dict)
        _, seed, seed_source = S.resolve_seed(state_dict, self._seed, self._seed_source)
        self._restore(state_dict)
        self._seed, self._seed_source = seed, seed_source
        self._epoch = state_dict[S.EPOCH]
        _carried.restore(self._life, state_dict, "")

    def validate_state(self, state_dict: Mapping[str, Any], source: str = "") -> None:
        """Raise if ``state_dict`` cannot be loaded into this loader; changes nothing."""
        S.check_shape(state_dict, source)
        mismatches = []
        if state_dict[S.MODE] != self.mode:
            mismatches.append(Mismatch(S.MODE, state_dict[S.MODE], self.mode))
        config = self._config_for(state_dict)
        mismatches += S.config_mismatches(state_dict[S.CONFIG], config)
        if any(m.field == "batch_size" for m in mismatches):
            refusal = self._rebatch_refusal(state_dict)
            if refusal is None:
                mismatches = [m for m in mismatches if m.field != "batch_size"]
            elif len(mismatches) == 1:
                where = f" ({source})" if source else ""
                raise UnsupportedConfigError(f"cannot resume{where}: {refusal}")
        seed_mismatch, _, _ = S.resolve_seed(state_dict, self._seed, self._seed_source)
        if seed_mismatch is not None:
            mismatches.append(seed_mismatch)
        sampler_change = _refusals.world_dependent_sampler(state_dict, config, self.ctx.world_size)
        if sampler_change is not None:
            where = f" ({source})" if source else ""
            raise UnsupportedConfigError(f"cannot resume{where}: {sampler_change}")
        _refusals.raise_mismatches(mismatches, source)
        self._check_position(state_dict, source)
        mark = check_entry(state_dict, f" in {source}" if source else "")
        if mark is not None:
            self.validate_state(mark, source)

    def _config_for(self, state_dict: Mapping[str, Any]) -> dict:
        """The settings ``state_dict``'s are compared with: this loader's at the saved world size."""
        return self._config_at(state_dict[S.TOPOLOGY].get("world_size"))

    def needs_all_ranks(self, state_dict: Mapping[str, Any]) -> bool:
        """Whether resuming from ``state_dict`` (this rank's saved state) needs every saved rank's state."""
        return state_dict[S.TOPOLOGY].get("world_size") != self.ctx.world_size

    def merge_rank_states(self, states: list) -> Mapping[str, Any]:
        """The one state to resume from on another topology, from every saved rank's state.

        By default the main process's, once every rank is known to agree on the epoch, the position and
        the pass that was live; a live pass's starting point is merged the same way (``_compare.merged_state``).
        """
        return _compare.merged_state(states, self.merge_rank_states)

    def skip_samples(self, start: int, stop: int, epoch: Optional[int] = None) -> None:
        """Leave out positions ``start`` to ``stop - 1`` of an epoch's order: map-style loaders (``ShardDataLoader``,
        ``DispatchDataLoader`` over map-style data); refused here."""
        raise UnsupportedConfigError(
            f"skip_samples() needs map-style data read by position (DataLoader(batch_size=...) over a dataset with "
            f"__len__ and __getitem__); the {self.mode} loader over {type(self.dataset).__name__} reads batches or "
            "a stream, whose samples have no place in a global order to leave out; leave them out in the dataset "
            "(filter them in __iter__, or wrap the dataset so that it skips them), or read the stream through the "
            "composable sources of accelerate_stateful.sources (Mixture, Packed, Shuffled, exact_shuffle), whose "
            "items have global indices that skip_samples leaves out"
        )

    @property
    def skipped_samples(self) -> list[tuple[int, int, int]]:
        """The ranges ``(epoch, start, stop)`` left out (``skip_samples``), as saved with the position."""
        return [tuple(r) for r in self._left_out()]

    def _left_out(self) -> Sequence[Sequence[int]]:
        """Hook: the ranges ``[epoch, start, stop]`` this loader leaves out (none where it refuses them)."""
        return ()

    def _batch_change(self, state_dict: Mapping[str, Any]) -> Optional[tuple[Any, Any]]:
        """``(saved, current)`` batch size when this run's differs from the checkpoint's, else ``None``."""
        saved, current = state_dict[S.CONFIG].get("batch_size"), self._config().get("batch_size")
        return None if saved == current else (saved, current)

    def _relaid(self, state_dict: Mapping[str, Any]) -> bool:
        """Whether the saved position is cut into steps of another shape here: another number of processes or
        another batch size (the rest of the epoch is then re-cut from the first sample nobody took)."""
        return (state_dict[S.TOPOLOGY].get("world_size") != self.ctx.world_size
                or self._batch_change(state_dict) is not None)

    def _rebatch_refusal(self, state_dict: Mapping[str, Any]) -> Optional[str]:
        """Why the saved position cannot continue at this run's batch size (``None``: it can, exactly).

        By default it cannot: the variant's position is a place between batches of the saved size.
        """
        saved, current = self._batch_change(state_dict)
        return (
            f"the checkpoint was written with batch_size={saved}, this run has batch_size={current}, and the "
            f"{self.mode} loader's saved position is a place between batches of {saved}, which cannot be cut "
            f"again into batches of {current}; resume with batch_size={saved}, or start a fresh run"
        )

    # ----------------------------------------------------------------- lifecycle internals
    def _refuse_if_live(self, action: str) -> None:
        if self._life.is_live():
            raise LifecycleError(
                f"{action} called while an iterator over this loader is live (epoch {self._epoch}, "
                f"{self._batches_taken()} batches taken); finish or drop that iterator first, "
                "or call it before iter()"
            )

    def _digest(self) -> tuple:
        """What every rank must agree on when a checkpoint is taken or loaded (``checkpoint._in_step``): the
        lifecycle's point, and the ranges left out (every process must leave out the same samples)."""
        with self._life.lock:
            key, point = self._life.digest()
        skips = tuple(map(tuple, self._left_out()))
        return (key, skips), point + (skips,)

    def _data_digest(self) -> list[tuple[str, Any, str]]:
        """What defines this loader's data, ``(what, value, fix)``: compared across processes with the digest
        when a checkpoint is taken or loaded (``checkpoint._in_step``, ``checkpoint._compare``)."""
        return _compare.data_digest(self)

    def _has_live_pass(self, collected: bool = False) -> bool:
        return self._life.is_live(collected)

    def _has_open_pass(self) -> bool:
        return self._life.has_open_pass()

    def _anchor(self) -> None:
        """The program starts here (a resume that found nothing): count its warm-up passes anew."""
        self._life.anchor()

    def _all_taken(self) -> int:
        """A finished epoch's batch count after a resume on another number of processes: this loader's length
        (0 for a stream without one)."""
        try:
            return len(self)
        except TypeError:
            return 0

    def _stand_at_finished_epoch(self) -> None:
        """Between two epochs after a resume: stand at the end of the finished one, every batch taken (how the
        command line describes such a checkpoint). Streams, which cannot be positioned, stay where they are."""
        boundary = self._life.boundary()
        if boundary is None:
            return
        try:
            self._start_epoch(boundary[0])
            self._seek(len(self))
        except (TypeError, UnsupportedConfigError):  # a stream: no length, no seek
            self._end_epoch()
            return
        self._life.leave_boundary()
        self._life.phase = Phase.RESTORED

    def _epoch_complete(self) -> bool:
        """Whether every rank has taken every batch of the epoch (the position is the epoch's end).

        Asked after a batch handed out, only once ``end_of_dataloader`` is set (this rank's last batch: an epoch
        cannot be complete before it). By default this rank's last batch was just handed out (streams, the
        dispatcher: a read ahead knows it); position-based variants override it.
        """
        return self.end_of_dataloader and self._life.live is not None

    def _epoch_complete_at_restore(self) -> bool:
        """Whether a restored position is its epoch's end (a state written by an earlier release, which
        recorded an epoch's end as its last batch); ``False`` where only reading can tell."""
        return False

    def _place(self, batch: Any) -> Any:
        """The batch on this loader's device (Accelerate's device placement)."""
        device = self.device
        if device is None:
            return batch
        if type(batch) is Tensor and batch.device == device:
            return batch  # what ``send_to_device`` returns for it (``Tensor.to`` a tensor's own device), for less
        return send_to_device(batch, device, non_blocking=self.non_blocking)

    def _begin(self) -> None:
        self.end_of_dataloader = False
        self.remainder = self._remainder()
        # The pass keeps the GradientState it registered with (as Accelerate's own loaders keep theirs): making one
        # is a third of what ``_activate`` costs at every batch.
        self._gradient_state = GradientState()
        self._weak_self = weakref.ref(self)  # kept: GradientState's reference to this loader is then this object
        self._gradient_state._add_dataloader(self)

    def _activate(self) -> None:
        """Accelerate's ``GradientState`` follows the loader whose batch the loop took last.

        Its ``end_of_dataloader`` (the sync of ``accelerator.accumulate``) and ``remainder``
        (``gather_for_metrics``) are then those of the batch being trained on, whatever order passes began in.
        """
        state = self._gradient_state
        # The weak references behind ``dataloader_references`` (whose getter copies them all at every read): the
        # last is this loader's own when it is the one ``_begin`` made, which CPython hands out again for it.
        references = state._dataloader_references_ref
        if not references or references[-1] is not self._weak_self:
            state.dataloader_references = [ref for ref in state.dataloader_references if ref is not self] + [self]

    def _end(self) -> None:
        """The pass's verdict is taken: Accelerate stops following this loader, and the pass's workers end (unless
        persistent: the base loader keeps those)."""
        GradientState()._remove_dataloader(self)
        self._live_base = None

    def _fetch_key(self, origin: int) -> tuple[int, ...]:
        """What the pipeline randomness of a batch of this pass is drawn from, with the batch's step
        (``training/_rng``): the loader's seed, the epoch, the rank, and where the epoch's current dealing began."""
        return self._seed, self._epoch, self.ctx.rank, origin

    def _epoch_start_batches(self, count: int) -> list:
        """Hook: this rank's first ``count`` batches of the current epoch (fewer in a shorter epoch), fetched
        again in this process as its pass fetched them, moving nothing: what a dispatcher moved by ``seek``
        pads its last step with. A loader that cannot read them without reading its data from the start (a
        stream) refuses ``seek`` itself, so this is never asked of it."""
        raise NotImplementedError(f"{type(self).__name__} cannot fetch its epoch's first batches again")

    def _open_base(self) -> Iterator[Any]:
        """The base loader's batches (``_torch_iter``: without torch's per-batch profiler annotation while no
        profiler records), its iterator remembered so that its workers can be stopped at once (a pass ended by
        an exception, the process's end: ``_workers``)."""
        base_iter = iter(self._base)
        self._base_iter = weakref.ref(base_iter)
        self._live_base = base_iter
        track(base_iter)
        return batches_of(base_iter)

    def _release_workers(self) -> None:
        """Stop the workers of this loader's base iterator now (a pass ended by an exception); persistent
        workers too: the next pass starts new ones."""
        base_iter = self._base_iter() if self._base_iter is not None else None
        if base_iter is not None:
            shut_down(base_iter, self._base)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_base_iter"] = state["_gradient_state"] = state["_live_base"] = state["_weak_self"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._life._loader = weakref.proxy(self)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(epoch={self._resume_point()[0]}, batches_yielded={self.batches_yielded}, "
            f"phase={self.phase.value!r}, rank={self.ctx.rank}/{self.ctx.world_size})"
        )

    # ----------------------------------------------------------------- variant hooks
    def __len__(self) -> int:
        raise NotImplementedError

    def _batches(self) -> Iterator[Any]:
        """Yield the epoch's batches from the current position, advancing it before each yield."""
        raise NotImplementedError

    def _open_pass(self) -> Iterator[tuple[Any, Any]]:
        """``(token, batch)`` pairs of a pass from the current position; the position does not move.

        A reader inside another loader (the dispatcher) reads ahead with this and
        commits a token only when the batch it belongs to reaches the training loop.
        """
        raise NotImplementedError

    def _commit(self, token: Any) -> None:
        """Move the position past the batch ``token`` came with."""
        raise NotImplementedError

    def _batches_taken(self) -> int:
        raise NotImplementedError

    def _position_state(self) -> dict:
        raise NotImplementedError

    def _config(self) -> dict:
        raise NotImplementedError

    def _config_at(self, world_size: Any) -> dict:
        """``_config()`` as this loader would have on ``world_size`` processes (a saved state's, to compare)."""
        return self._config()

    def _base_state(self) -> Any:
        return None

    def _position_mark(self) -> Any:
        """Hook: the position as a value :meth:`_state_before` can go back from (taken at an epoch's end too,
        once per epoch, so cheap: references, no copies); ``None`` where the variant cannot go back."""
        return None

    def _state_before(self, mark: Any, count: int) -> Optional[dict]:
        """Hook: the raw state ``count`` batches (of this rank's) before the position ``mark``; ``None`` where the
        variant cannot go back cheaply (a stream read by workers: the put-back is then said in a warning)."""
        return None

    def _remainder(self) -> int:
        return -1

    def _check_position(self, state_dict: Mapping[str, Any], source: str) -> None:
        """Raise if the saved position cannot be continued here."""

    def _restore(self, state_dict: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def _rewind(self) -> None:
        """Back to the start of the current epoch."""
        raise NotImplementedError

    def _seek(self, num_batches: int) -> None:
        """Move to batch ``num_batches`` of the epoch (0 <= it), refusing a count past its end."""
        raise NotImplementedError

    def _refuse_past_end(self, num_batches: int) -> None:
        if num_batches > len(self):
            raise ValueError(
                f"cannot skip {num_batches} batches: epoch {self._epoch} has {len(self)} batches on this rank"
            )

