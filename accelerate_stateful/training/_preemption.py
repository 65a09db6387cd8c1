"""Preemption: a signal asks for a checkpoint; every rank takes it at the end of the same optimizer step.

A scheduler announces the end of a job with a signal: SIGTERM (Kubernetes,
``torchrun`` and ``accelerate launch`` forwarding their own), SIGUSR1 (SLURM's
``--signal=USR1@<seconds>``). The signal can reach one rank, all of them, or all
of them at different steps, so a rank never acts on its own: once per optimizer
step the ranks combine their flags with one all-reduce (MAX) and all act on the
result. So either every rank saves at that step or none does, and no rank waits
in a collective the others never enter.

Where, in a hand-written loop (:class:`StepEndCheckpoint`): the decision is a
post-step hook of the first prepared optimizer, so it is taken only when that
optimizer really steps (at the end of a gradient-accumulation window), never in
a loader's ``next()``, ``iter()`` or ``len()``: an evaluation, uneven or on the
main process only, makes no collective. The all-reduce started at one step is
read at the next one, so it overlaps a whole step; every rank therefore saves
one step after the signal, still the same step everywhere. The checkpoint is
taken at the end of that step: right after the optimizer step, or, when a
learning-rate scheduler was prepared, right after every prepared scheduler has
stepped once more (the loop calls ``lr_scheduler.step()`` after
``optimizer.step()``), so the checkpoint holds the step whole and nothing of the
next one. The 🤗 Trainer decides with the same :meth:`PreemptionRequest.poll`
at its ``on_step_end`` (after its optimizer and scheduler steps) and saves
``checkpoint-N`` there (``integrations.transformers``).

The handler only records the signal. DataLoader workers started by ``fork``
inherit it (``accelerate launch`` sends the signal to each rank's whole
process group, workers included): in a worker it does nothing, so the workers
live on and the main process decides. Workers started with ``spawn`` or
``forkserver`` get ``SIG_IGN`` for these signals from :func:`ignore_in_worker`.

After the checkpoint is complete the process exits with
:data:`PREEMPTED_EXIT_CODE`; running the same command again resumes from it.
"""

from __future__ import annotations

import functools
import signal
import threading
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .. import _log
from ..errors import UnsupportedConfigError

if TYPE_CHECKING:
    from ..accelerator import Accelerator

logger = _log.get_logger(__name__)

PREEMPTION_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)
# 128 + SIGTERM, what a shell reports for a process ended by SIGTERM: "stopped because it was asked to".
PREEMPTED_EXIT_CODE = 143


class PreemptionRequest:
    """Records preemption signals in this process; :meth:`poll` tells every rank whether any rank got one.

    Args:
        signals: The signals that request a checkpoint.
        device: Where the flag is reduced (the accelerator's device: NCCL reduces CUDA tensors only).
    """

    def __init__(self, signals: Sequence[int] = PREEMPTION_SIGNALS, device: Optional[torch.device] = None) -> None:
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.device = device if device is not None else torch.device("cpu")
        self.received: Optional[signal.Signals] = None
        self._previous: dict[signal.Signals, Any] = {}
        self._pending: Optional[tuple[torch.Tensor, Any]] = None  # the all-reduce the next poll() reads

    def install(self) -> "PreemptionRequest":
        """Route the signals to this request (main thread only, as Python requires)."""
        if threading.current_thread() is not threading.main_thread():
            raise UnsupportedConfigError(
                "a preemption checkpoint needs its signal handlers installed from the main thread; start "
                "training from the main thread or turn preemption checkpoints off"
            )
        for sig in self.signals:
            self._previous.setdefault(sig, signal.signal(sig, self._record))
        return self

    def uninstall(self) -> None:
        """Give the signals back to the handlers they had before :meth:`install`."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        self._pending = None  # not waited for: on a failing rank, its peers may never make it

    def _record(self, signum: int, frame: Any) -> None:
        if torch.utils.data.get_worker_info() is not None:
            return  # a DataLoader worker forked with this handler: the main process decides
        if self.received is None:
            self.received = signal.Signals(signum)
            logger.warning("%s received: a checkpoint is taken at the end of a coming optimizer step", self.received.name)

    def poll(self) -> bool:
        """Whether any rank had received a signal by the previous call; every rank calls it once per step.

        A collective: it starts this call's all-reduce of the flag without waiting for it and reads the one
        started by the previous call, which a whole step has overlapped. Every rank makes the same calls, so
        every rank gets the same answer at the same call. In one process it reads the flag at once.
        """
        flag = self.received is not None
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return flag
        previous = self._pending
        tensor = torch.tensor([int(flag)], dtype=torch.int32, device=self.device)
        self._pending = (tensor, dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=True))
        if previous is None:
            return False
        previous[1].wait()
        return bool(previous[0].item())


def ignore_in_worker(worker_init_fn: Optional[Callable[[int], Any]], signals: Sequence[int]) -> Callable[[int], Any]:
    """``worker_init_fn`` that first sets ``SIG_IGN`` for ``signals``, then runs the user's own."""
    return functools.partial(_ignore_then_init, tuple(signals), worker_init_fn)


def _ignore_then_init(signals: tuple, worker_init_fn: Optional[Callable[[int], Any]], worker_id: int) -> Any:
    for sig in signals:
        signal.signal(sig, signal.SIG_IGN)
    return worker_init_fn(worker_id) if worker_init_fn is not None else None




class StepEndCheckpoint:
    """A hand-written loop's preemption checkpoint: decided once per optimizer step, taken at the end of the step.

    Made by :meth:`accelerate_stateful.Accelerator.checkpoint_on_preemption`; :meth:`uninstall` undoes it.

    Args:
        accelerator: The accelerator that saves (``save_state()``).
        request: The installed signal request.
    """

    def __init__(self, accelerator: "Accelerator", request: PreemptionRequest) -> None:
        self.accelerator = accelerator
        self.request = request
        # The first prepared optimizer decides: with several, the decision is still once per step.
        self._hook = accelerator._optimizers[0].optimizer.register_step_post_hook(self._stepped)
        self._schedulers = [s for s in accelerator._schedulers if getattr(s, "step_with_optimizer", True)]
        for scheduler in self._schedulers:
            scheduler.step = functools.partial(self._scheduled, scheduler, scheduler.step)
        self._waiting: Optional[set[int]] = None  # decided: the schedulers still to step before the save

    def uninstall(self) -> None:
        """Give the signals back, and stop deciding at the optimizer's and the schedulers' steps."""
        self.request.uninstall()
        self._hook.remove()
        for scheduler in self._schedulers:
            del scheduler.step  # the instance attribute set above: the class's step comes back
        self._schedulers = []

    def _stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._waiting is None and self.request.poll():
            self._waiting = {id(s) for s in self._schedulers}
            self._save_when_step_ends()

    def _scheduled(self, scheduler: Any, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        result = step(*args, **kwargs)
        if self._waiting is not None:
            self._waiting.discard(id(scheduler))
            self._save_when_step_ends()
        return result

    def _save_when_step_ends(self) -> None:
        if self._waiting:
            return  # a prepared scheduler has yet to take this step's step
        # The step's gradient was spent by the optimizer step that ends here (the loop zeroes it next): not
        # carried, else the resumed run would add the next step's gradient to it.
        carry, self.accelerator.carry_gradients = self.accelerator.carry_gradients, False
        try:
            path = self.accelerator.save_state()
        finally:
            self.accelerator.carry_gradients = carry
        if self.accelerator.is_main_process:
            logger.warning(
                "preempted (%s on some rank): checkpoint %s is complete; exiting with status %d, the same command "
                "resumes", self.request.received.name if self.request.received is not None else "signal", path,
                PREEMPTED_EXIT_CODE,
            )
        raise SystemExit(PREEMPTED_EXIT_CODE)


def checkpoint_on_preemption(accelerator: "Accelerator", loaders: Sequence[Any], signals: Sequence[int]) -> StepEndCheckpoint:
    """Install the signal handlers and the end-of-step checkpoint; ``loaders``' workers ignore the signals.

    See :meth:`accelerate_stateful.Accelerator.checkpoint_on_preemption`.
    """
    if not accelerator.use_stateful_dataloader or not accelerator.project_configuration.automatic_checkpoint_naming:
        raise UnsupportedConfigError(
            "checkpoint_on_preemption() saves with save_state() and resumes with resume(): it needs "
            "DataLoaderConfiguration(use_stateful_dataloader=True) and "
            "ProjectConfiguration(automatic_checkpoint_naming=True)"
        )
    if not loaders:
        raise UnsupportedConfigError(
            "checkpoint_on_preemption() found no prepared stateful loader; call it after accelerator.prepare(...)"
        )
    if not accelerator._optimizers:
        raise UnsupportedConfigError(
            "checkpoint_on_preemption() takes the checkpoint at the end of an optimizer step and found no prepared "
            "optimizer; prepare the optimizer with accelerator.prepare(...) before calling it"
        )
    request = PreemptionRequest(signals, accelerator.device).install()
    for loader in loaders:
        base = loader.unwrap()
        if base.num_workers > 0:
            base.worker_init_fn = ignore_in_worker(base.worker_init_fn, request.signals)
    return StepEndCheckpoint(accelerator, request)
