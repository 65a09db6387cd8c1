"""DataLoaderAdapter: holds a base loader, owns the lifecycle and the state template."""

from __future__ import annotations

import enum
import weakref
from typing import Any, Callable, ClassVar, Generator, Iterator, Mapping, Optional

import torch
from accelerate.state import GradientState
from accelerate.utils import send_to_device
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import DataLoader

from ..checkpoint import _state as S
from ..checkpoint import _refusals
from ..training import _training
from .._context import DistContext
from ._passes import PassOrigin, empty_tail_note
from ..errors import CheckpointError, LifecycleError, Mismatch, UnsupportedConfigError


class Phase(enum.Enum):
    """Where a loader is in its lifecycle (see ``docs/lifecycle.md``)."""

    NOT_STARTED = "not started"
    ITERATING = "iterating"
    EXHAUSTED = "exhausted"
    RESTORED = "restored"


class DataLoaderAdapter(Stateful):
    """A prepared loader: wraps a base ``DataLoader`` by composition.

    The adapter owns the lifecycle and the public ``state_dict()`` /
    ``load_state_dict()`` (version, validation, lifecycle checks); a variant
    implements the position hooks (``_batches``, ``_position_state``,
    ``_restore``, ``_rewind``, ``_seek``, ``_config``) and ``__len__``.

    Lifecycle:

    ============  ======================  ===========================  ====================
    state         ``iter()``              ``state_dict()``             ``load_state_dict()``
    ============  ======================  ===========================  ====================
    not started   start epoch ``epoch``   start of epoch ``epoch``     allowed → restored
    iterating     close it, see below     after the last batch taken   error while live
    exhausted     start epoch ``epoch``   start of epoch ``epoch``     allowed → restored
    restored      continue from there     the restored position        allowed (replaces)
    ============  ======================  ===========================  ====================

    On exhaustion ``epoch`` moves to the next epoch at once, so ``set_epoch``
    with the loader's own epoch never disturbs a position. A pass dropped
    before its end is undone, or ends its epoch if the model was trained
    while it was live (``_passes``).
    """

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
        self._phase = Phase.NOT_STARTED
        self._live: Optional[weakref.ref] = None
        self._pass_origin: Optional[PassOrigin] = None
        _training.install()
        self.end_of_dataloader = False
        self.remainder = -1
        # Called when the loop asks for the batch after one it took (see ``_preemption``); None: no call.
        self.on_batch_returned: Optional[Callable[[], None]] = None

    # ----------------------------------------------------------------- public surface
    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to."""
        return self._epoch

    @property
    def phase(self) -> Phase:
        return self._phase

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
        return self._batches_taken()

    def progress(self) -> Optional[float]:
        """The part of the current epoch already taken, from 0 to 1; ``None`` for a stream without a length."""
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

    def __iter__(self) -> Iterator[Any]:
        live = self._live_iterator()
        if live is not None:
            live.close()  # runs the end of that pass (``_run``'s ``finally``)
        if self._phase is Phase.ITERATING:  # a copy made while a pass was live: that pass is gone
            self._abandon()
        run = self._run()
        self._live = weakref.ref(run)
        return run

    def set_epoch(self, epoch: int) -> None:
        """Move to the start of ``epoch``; with the current epoch this changes nothing."""
        if epoch == self._epoch:
            return
        self._refuse_if_live("set_epoch()")
        self._start_epoch(epoch)

    def _start_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        self._rewind()
        self._phase = Phase.NOT_STARTED

    def seek(self, num_batches: int) -> None:
        """Position the loader ``num_batches`` into the epoch its next batch belongs to, reading nothing.

        That is the current epoch, unless the loader was restored after the epoch's last batch: then it is
        the next one (Accelerate's recipe, ``skip_first_batches(dl, step % len(dl))``, at an epoch boundary).
        """
        self._refuse_if_live("seek()")
        if num_batches < 0:
            raise ValueError(f"cannot skip {num_batches} batches: the count must be >= 0")
        if self._phase is Phase.RESTORED and self._at_epoch_end():
            self._start_epoch(self._epoch + 1)
        self._seek(num_batches)
        self._phase = Phase.RESTORED

    def state_dict(self) -> S.LoaderState:
        """The complete position, valid in every lifecycle state (no side effects)."""
        state = {
            S.VERSION: S.FORMAT_VERSION,
            S.MODE: self.mode,
            S.EPOCH: self._epoch,
            S.SEED: self._seed,
            S.SEED_SOURCE: self._seed_source,
            S.TOPOLOGY: {"world_size": self.ctx.world_size, "rank": self.ctx.rank, "num_workers": self.num_workers},
            S.CONFIG: self._config(),
            S.BASE: self._base_state(),
        }
        state.update(self._position_state())
        return state  # type: ignore[return-value]

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a position saved by ``state_dict()``; refused while an iterator is live."""
        self._refuse_if_live("load_state_dict()")
        self.validate_state(state_dict)
        _, seed, seed_source = S.resolve_seed(state_dict, self._seed, self._seed_source)
        self._restore(state_dict)
        self._seed, self._seed_source = seed, seed_source
        self._epoch = state_dict[S.EPOCH]
        self._phase = Phase.RESTORED

    def validate_state(self, state_dict: Mapping[str, Any], source: str = "") -> None:
        """Raise if ``state_dict`` cannot be loaded into this loader; changes nothing."""
        S.check_shape(state_dict, source)
        mismatches = []
        if state_dict[S.MODE] != self.mode:
            mismatches.append(Mismatch(S.MODE, state_dict[S.MODE], self.mode))
        mismatches += S.config_mismatches(state_dict[S.CONFIG], self._config())
        seed_mismatch, _, _ = S.resolve_seed(state_dict, self._seed, self._seed_source)
        if seed_mismatch is not None:
            mismatches.append(seed_mismatch)
        sampler_change = _refusals.world_dependent_sampler(state_dict, self._config(), self.ctx.world_size)
        if sampler_change is not None:
            where = f" ({source})" if source else ""
            raise UnsupportedConfigError(f"cannot resume{where}: {sampler_change}")
        _refusals.raise_mismatches(mismatches, source)
        self._check_position(state_dict, source)

    def needs_all_ranks(self, state_dict: Mapping[str, Any]) -> bool:
        """Whether resuming from ``state_dict`` (this rank's saved state) needs every saved rank's state."""
        return state_dict[S.TOPOLOGY].get("world_size") != self.ctx.world_size

    def merge_rank_states(self, states: list) -> Mapping[str, Any]:
        """The one state to resume from on another topology, from every saved rank's state.

        By default the main process's, once every rank is known to agree on the epoch and position.
        """
        for rank, state in enumerate(states[1:], start=1):
            for key in (S.EPOCH, S.SAMPLES_CONSUMED, S.STRIPE_ORIGIN):
                if isinstance(state, Mapping) and isinstance(states[0], Mapping) and state.get(key) != states[0].get(key):
                    raise CheckpointError(
                        f"cannot resume on another number of processes: the processes were at different points of "
                        f"the data when it was saved (rank 0: {_refusals.where(states[0])}; rank {rank}: {_refusals.where(state)}), "
                        "so no single position can be re-dealt to the new processes; resume it on the same number "
                        "of processes, or from a checkpoint saved while the processes were in step"
                    )
        return states[0]

    # ----------------------------------------------------------------- lifecycle internals
    def _run(self) -> Generator[Any, None, Optional[str]]:
        origin = self._pass_origin = PassOrigin.of(self)
        self._phase = Phase.ITERATING
        self._begin()
        batches = self._batches()
        finished = False
        try:
            for batch in batches:
                yield batch
                if self.on_batch_returned is not None:
                    self.on_batch_returned()
            finished = True
        finally:
            batches.close()
            self._end()
            self._end_epoch() if finished else self._abandon()
        # A ``for`` loop ignores this; a bare ``next(iter(dl))`` shows it with its StopIteration.
        return empty_tail_note(origin, len(self)) if origin.at_end else None

    def _end_epoch(self) -> None:
        self._pass_origin = None
        self._epoch += 1
        self._rewind()
        self._phase = Phase.EXHAUSTED

    def _abandon(self) -> None:
        """A pass dropped before its end: it truncated its epoch if the model was trained, else it is undone."""
        origin, self._pass_origin = self._pass_origin, None
        if origin is None:  # a loader state from before this rule: restart the epoch, as it used to
            self._start_epoch(self._epoch)
            return
        if origin.truncated_by_training(self._batches_taken()):
            self._end_epoch()
            return
        if origin.mark is None:
            self._rewind()
        else:
            self._restore(origin.mark)
        self._epoch, self._phase = origin.epoch, origin.phase

    def _at_epoch_end(self) -> bool:
        """Whether every batch of the current epoch has been taken (a position restored at the epoch's end)."""
        try:
            total = len(self)
        except TypeError:  # a stream without a length
            return False
        return total > 0 and self._batches_taken() >= total

    def _live_iterator(self) -> Optional[Generator]:
        run = self._live() if self._live is not None else None
        return run if run is not None and run.gi_frame is not None else None

    def _refuse_if_live(self, action: str) -> None:
        if self._live_iterator() is not None:
            raise LifecycleError(
                f"{action} called while an iterator over this loader is live (epoch {self._epoch}, "
                f"{self.batches_yielded} batches taken); finish or drop that iterator first, "
                "or call it before iter()"
            )

    def _place(self, batch: Any) -> Any:
        """The batch on this loader's device (Accelerate's device placement)."""
        if self.device is None:
            return batch
        return send_to_device(batch, self.device, non_blocking=self.non_blocking)

    def _begin(self) -> None:
        self.end_of_dataloader = False
        self.remainder = self._remainder()
        GradientState()._add_dataloader(self)

    def _end(self) -> None:
        GradientState()._remove_dataloader(self)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_live"] = None
        return state

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(epoch={self._epoch}, batches_yielded={self.batches_yielded}, "
            f"phase={self._phase.value!r}, rank={self.ctx.rank}/{self.ctx.world_size})"
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

    def _base_state(self) -> Any:
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
