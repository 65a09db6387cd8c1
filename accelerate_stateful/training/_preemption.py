"""Preemption: a signal asks for a checkpoint; every rank takes it at the same optimizer-step boundary.

A scheduler announces the end of a job with a signal: SIGTERM (Kubernetes,
``torchrun`` and ``accelerate launch`` forwarding their own), SIGUSR1 (SLURM's
``--signal=USR1@<seconds>``). The signal can reach one rank, all of them, or all
of them at different steps, so a rank never acts on its own: at every
optimizer-step boundary the ranks combine their flags with one all-reduce (MAX)
and all act on the result. So either every rank saves at that step or none
does, and no rank waits in a collective the others never enter.

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
import logging
import signal
import threading
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import UnsupportedConfigError

if TYPE_CHECKING:
    from ..accelerator import Accelerator

logger = logging.getLogger(__name__)

PREEMPTION_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)
# 128 + SIGTERM, what a shell reports for a process ended by SIGTERM: "stopped because it was asked to".
PREEMPTED_EXIT_CODE = 143


class PreemptionRequest:
    """Records preemption signals in this process; :meth:`agreed` tells every rank whether any rank got one.

    Args:
        signals: The signals that request a checkpoint.
        device: Where the flag is reduced (the accelerator's device: NCCL reduces CUDA tensors only).
    """

    def __init__(self, signals: Sequence[int] = PREEMPTION_SIGNALS, device: Optional[torch.device] = None) -> None:
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.device = device if device is not None else torch.device("cpu")
        self.received: Optional[signal.Signals] = None
        self._previous: dict[signal.Signals, Any] = {}

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

    def _record(self, signum: int, frame: Any) -> None:
        if torch.utils.data.get_worker_info() is not None:
            return  # a DataLoader worker forked with this handler: the main process decides
        if self.received is None:
            self.received = signal.Signals(signum)
            logger.warning("%s received: a checkpoint is taken at the next optimizer step", self.received.name)

    def agreed(self) -> bool:
        """Whether any rank received a signal; a collective, so every rank must call it at the same step."""
        flag = self.received is not None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            tensor = torch.tensor([int(flag)], dtype=torch.int32, device=self.device)
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
            flag = bool(tensor.item())
        return flag


def ignore_in_worker(worker_init_fn: Optional[Callable[[int], Any]], signals: Sequence[int]) -> Callable[[int], Any]:
    """``worker_init_fn`` that first sets ``SIG_IGN`` for ``signals``, then runs the user's own."""
    return functools.partial(_ignore_then_init, tuple(signals), worker_init_fn)


def _ignore_then_init(signals: tuple, worker_init_fn: Optional[Callable[[int], Any]], worker_id: int) -> Any:
    for sig in signals:
        signal.signal(sig, signal.SIG_IGN)
    return worker_init_fn(worker_id) if worker_init_fn is not None else None


def checkpoint_on_preemption(accelerator: "Accelerator", loaders: Sequence[Any], signals: Sequence[int]) -> PreemptionRequest:
    """Make ``loaders`` check, when the loop asks for the batch after an optimizer step, for a signal.

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
    request = PreemptionRequest(signals, accelerator.device).install()
    boundary = functools.partial(_at_batch_boundary, accelerator, request)
    for loader in loaders:
        base = loader.unwrap()
        if base.num_workers > 0:
            base.worker_init_fn = ignore_in_worker(base.worker_init_fn, request.signals)
        loader.on_batch_returned = boundary
    return request


def _at_batch_boundary(accelerator: "Accelerator", request: PreemptionRequest) -> None:
    """Between two batches: at an optimizer-step boundary, save and exit if any rank was signalled."""
    if not accelerator.sync_gradients:
        return  # inside a gradient-accumulation window: the step is not taken yet
    if not request.agreed():
        return
    path = accelerator.save_state()
    if accelerator.is_main_process:
        logger.warning(
            "preempted (%s on some rank): checkpoint %s is complete; exiting with status %d, the same command resumes",
            request.received.name if request.received is not None else "signal", path, PREEMPTED_EXIT_CODE,
        )
    raise SystemExit(PREEMPTED_EXIT_CODE)
