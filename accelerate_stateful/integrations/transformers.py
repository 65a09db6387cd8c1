"""🤗 Trainer and TRL: exact, replay-free resume of ``train(resume_from_checkpoint=True)``.

``StatefulTrainer`` (a ``transformers.Trainer``) and ``stateful(TrainerClass)`` (any subclass, e.g.
TRL's ``SFTTrainer``) train with this package's :class:`~accelerate_stateful.Accelerator` and
stateful loaders. The rule: **the loader owns the data position**. Each ``checkpoint-N`` holds every
rank's loader state and, written last, a manifest that marks it complete; on resume the loader is
restored from it and the Trainer's own counters (epoch, batches trained in the epoch) are taken from
the loader, so the Trainer skips nothing: nothing is read twice and nothing is replayed. See
``docs/trainer.md``.

The Trainer offers no override point for three of its steps, so ``_trainer_compat.swapped`` replaces
three names of ``transformers.trainer`` while one of this module's methods runs: ``Accelerator`` (while
the accelerator is built), ``skip_first_batches`` (while the resumed epoch runs) and
``rotate_checkpoints`` (while a checkpoint is saved: old checkpoints go only after the new one is
complete). ``check_transformers`` verifies them and the private methods overridden here, and names the
supported versions when a transformers release changes them.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Any, Optional, Union

import transformers
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..checkpoint import _lines
from .. import _log
from ..checkpoint import _checkpoints
from ..checkpoint import _files
from ..checkpoint import _in_step
from ..training import _preemption
from ..training import _record_switch
from ..checkpoint import _resume
from ..loaders._adapter import DataLoaderAdapter
from .._context import DistContext
from ._trainer_checkpoints import checkpoint_step, clear_leftover, latest_trainer_checkpoint, rotate_after_save
from . import _trainer_ahead, _trainer_stock
from ._trainer_compat import SUPPORTED_TRANSFORMERS, check_transformers, hf_trainer, swapped
from ..accelerator import Accelerator
from ..errors import StatefulLoaderError, UnsupportedConfigError

logger = _log.main_process_logger(__name__)


class _TrainerAccelerator(Accelerator):
    """This package's Accelerator, built from the Trainer's own arguments, with stateful loaders on."""

    def __init__(self, *args: Any, dataloader_config: Any = None, **kwargs: Any) -> None:
        if dataloader_config is None:
            dataloader_config = hf_trainer.DataLoaderConfiguration()
        dataloader_config.use_stateful_dataloader = True
        super().__init__(*args, dataloader_config=dataloader_config, **kwargs)


class _PreemptionCallback(TrainerCallback):
    """At the end of every optimizer step (after the scheduler's step) the ranks agree with ``poll()`` on whether
    any was signalled; if so: save ``checkpoint-N``, then exit. Never inside a loader's ``next()``."""

    def __init__(self, request: _preemption.PreemptionRequest) -> None:
        self.request = request
        self.preempted = False

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.request.poll():
            self.preempted = True
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.preempted:
            if state.is_world_process_zero:
                logger.warning(
                    "preempted: checkpoint-%d is complete; exiting with status %d, the same command resumes",
                    state.global_step, _preemption.PREEMPTED_EXIT_CODE,
                )
            raise SystemExit(_preemption.PREEMPTED_EXIT_CODE)
        return control


class _Resumed:
    """Where the restored loader stands: the epoch, the batches of it this rank took, and its batch count."""

    def __init__(self, epoch: int, taken: int, batches: Optional[int], saved_world: int) -> None:
        self.epoch, self.taken, self.batches, self.saved_world = epoch, taken, batches, saved_world


class StatefulTrainerMixin:
    """The behaviour :func:`stateful` adds to a Trainer class; see :class:`StatefulTrainer`."""

    def __init__(self, *args: Any, preemption_signals: Any = _preemption.PREEMPTION_SIGNALS, **kwargs: Any) -> None:
        check_transformers()
        self._resume_dir: Optional[Path] = None
        self._train_loader: Optional[DataLoaderAdapter] = None
        self._resumed: Optional[_Resumed] = None
        self._resume_stock = False  # the checkpoint to resume is stock Trainer's (``_trainer_stock``)
        self._resume_manifest: Optional[dict] = None  # its manifest, once every file was checked
        self._preemption = _preemption.PreemptionRequest(preemption_signals) if preemption_signals else None
        super().__init__(*args, **kwargs)
        if getattr(self.args, "enable_jit_checkpoint", False):
            raise UnsupportedConfigError(
                "enable_jit_checkpoint=True saves wherever the loop stands when SIGTERM arrives, possibly after "
                "the next accumulation window was fetched, which cannot be resumed exactly; drop it: this Trainer "
                "saves on SIGTERM/SIGUSR1 at the next optimizer step, agreed by all ranks (preemption_signals)"
            )
        if self._preemption is not None:
            self._preemption.device = self.accelerator.device
            self.add_callback(_PreemptionCallback(self._preemption))

    # ----------------------------------------------------------------- public override points
    def create_accelerator_and_postprocess(self) -> None:
        with swapped("Accelerator", _TrainerAccelerator):
            super().create_accelerator_and_postprocess()

    def train(self, resume_from_checkpoint: Union[str, bool, None] = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint=True`` takes the newest complete checkpoint, or starts fresh."""
        self._resume_dir = self._checkpoint_to_resume(resume_from_checkpoint)
        if self._resume_dir is not None and not self._resume_stock:  # every byte checked before the model loads
            self._resume_manifest = _resume.verify_once(DistContext.detect(), self._resume_dir)
        if resume_from_checkpoint and self.args.ignore_data_skip and not self._resume_stock:
            raise UnsupportedConfigError(
                "ignore_data_skip=True asks to start the resumed epoch from its first batch, but this Trainer "
                "resumes the data position exactly; drop ignore_data_skip, or resume with transformers.Trainer"
            )
        if self.args.save_strategy != "no":  # once the run is accepted, before the first step: no save meets them
            _trainer_ahead.move_aside(DistContext.detect(), Path(self.args.output_dir), self._resume_dir)
        if self._preemption is not None:
            self._preemption.install()
        try:
            resume = None if self._resume_dir is None else str(self._resume_dir)
            return super().train(resume, *args, **kwargs)
        finally:
            if self._preemption is not None:
                self._preemption.uninstall()
            self._resume_dir = self._resumed = self._resume_manifest = None
            self._resume_stock = False

    def get_train_dataloader(self) -> Any:
        loader = super().get_train_dataloader()
        if not isinstance(loader, DataLoaderAdapter):
            raise UnsupportedConfigError(
                f"the training loader was prepared as {type(loader).__name__}, not as a stateful loader; "
                "StatefulTrainer needs get_train_dataloader() to return accelerator.prepare(DataLoader(...))"
            )
        if self._preemption is not None and loader.num_workers > 0:
            base = loader.unwrap()
            base.worker_init_fn = _preemption.ignore_in_worker(base.worker_init_fn, self._preemption.signals)
        self._train_loader = loader
        return loader

    def set_initial_training_values(self, args: Any, dataloader: Any) -> tuple:
        """The Trainer's counts for this run; on resume, the loader's position is restored here first."""
        values = super().set_initial_training_values(args, dataloader)
        if self._resume_dir is not None and dataloader is self._train_loader and _record_switch.active is not None:
            _record_switch.active.resumed(self._resume_dir)  # `check-resume`: steps continue from the checkpoint's
        if self._resume_dir is None or self._resume_stock or dataloader is not self._train_loader:
            return values
        self._restore_loader(self._resume_dir)
        if self._resumed.saved_world == self.accelerator.num_processes or self._resumed.batches is None:
            return values
        return self._rescaled_values(values)

    # ----------------------------------------------------------------- private override points
    def _init_training_state(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        counters = super()._init_training_state(*args, **kwargs)
        if self._resume_stock:  # stock Trainer's counters and data skip; the skip moves the position
            self._train_loader.set_epoch(counters[0])
            self._train_loader.seek(counters[1])
            self._resumed = _Resumed(*counters, None, self.accelerator.num_processes)
            logger.warning(_trainer_stock.resume_line(self._resume_dir, *counters, self._train_loader))
        if self._resumed is None:
            return counters
        # The loader owns the position: the Trainer continues from its epoch and batch, skipping nothing.
        return self._resumed.epoch, self._resumed.taken

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        call = inspect.signature(super()._run_epoch).bind(*args, **kwargs)
        resumed = self._resumed
        if resumed is None or call.arguments["epoch"] != resumed.epoch or call.arguments["resume_from_checkpoint"] is None:
            return super()._run_epoch(*call.args, **call.kwargs)
        if resumed.batches is not None:
            # After a resume on another number of processes the epoch's rest is all this rank has left.
            call.arguments["steps_in_epoch"] = resumed.batches
            call.arguments["num_update_steps_per_epoch"] = max(
                math.ceil(resumed.batches / self.args.gradient_accumulation_steps), 1
            )
        with swapped("skip_first_batches", self._already_positioned):
            return super()._run_epoch(*call.args, **call.kwargs)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        run_dir = Path(self._get_output_dir(trial=trial))
        folder = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        self._clear_leftover(folder)
        with swapped("rotate_checkpoints", _no_rotation):
            super()._save_checkpoint(model, trial)
        if _record_switch.active is not None:  # before the seal: check-resume's kill "inside the save" lands here
            _record_switch.active.saving(folder)
        ctx = DistContext.detect()
        _in_step.settle(ctx, [self._train_loader], f"the Trainer's save of {folder.name}")
        contents = _files.encode_state(self._train_loader.state_dict())
        entries = _checkpoints.agree(ctx, lambda: _files.write_encoded(folder, 0, ctx.rank, contents))
        # Sealed like Accelerator.save_state: a manifest in every folder the ranks saved into, written last.
        _checkpoints.seal(ctx, folder, num_loaders=1, entries=entries)
        rotate_after_save(ctx, run_dir, self.args.save_total_limit, self.state.best_model_checkpoint,
                          rotates=self.accelerator.is_main_process and self.args.should_save)

    # ----------------------------------------------------------------- internals
    def _checkpoint_to_resume(self, resume_from_checkpoint: Union[str, bool, None]) -> Optional[Path]:
        if resume_from_checkpoint is None or resume_from_checkpoint is False:
            return None
        if resume_from_checkpoint is True:
            ctx = DistContext.detect()
            latest = latest_trainer_checkpoint(self.args.output_dir) if ctx.is_main else None
            stock = _trainer_stock.newest_stock(self.args.output_dir) if ctx.is_main else None
            latest = stock if _trainer_stock.newer(stock, latest) else latest
            is_stock = stock is not None and latest == stock
            agreed, self._resume_stock = ctx.broadcast((None if latest is None else str(latest), is_stock))
            if agreed is None:
                logger.warning(_lines.fresh_start_line(Path(self.args.output_dir), "TrainingArguments(output_dir=...)"))
            return None if agreed is None else Path(agreed)
        path = Path(resume_from_checkpoint)
        self._resume_stock = _trainer_stock.stock_step(path) is not None
        if not self._resume_stock:
            _files.read_manifest(path)  # raises CheckpointError, naming the problem, for an incomplete one
        return path

    def _restore_loader(self, checkpoint: Path) -> None:
        loader = self._train_loader
        ctx = DistContext.detect()
        manifest = self._resume_manifest or _resume.verify_once(ctx, checkpoint)
        (state,) = _resume.read_states(ctx, checkpoint, manifest, [loader])
        saved_world = manifest["world_size"]
        loader.load_state_dict(state)
        batches = _length(loader)
        epoch, taken, between = loader._resume_point()
        if between:  # saved after the epoch's last batch: the Trainer counts the epoch done, the next one starts
            loader.set_epoch(epoch + 1)
            epoch, taken, batches = epoch + 1, 0, None
        self._resumed = _Resumed(epoch, taken, batches, saved_world)
        logger.warning("resuming from %s: epoch %d, batch %d of this rank (nothing is skipped or replayed)",
                       checkpoint, epoch, taken)

    def _rescaled_values(self, values: tuple) -> tuple:
        """The run's counts after a resume on another number of processes (map-style data).

        ``global_step`` keeps counting optimizer steps; the rest of the interrupted epoch takes the steps the new
        topology needs, later epochs take a full epoch's steps at the new size. An epoch-based run ends after its
        last epoch (``max_steps`` is set to match, so the scheduler's horizon is that end); a ``max_steps`` run
        ends at ``max_steps`` (as many epochs as that needs).
        """
        epochs, per_epoch, examples, samples, total_batch, steps_in_epoch, max_steps = values
        global_step = hf_trainer.TrainerState.load_from_json(
            str(self._resume_dir / hf_trainer.TRAINER_STATE_NAME)).global_step
        rest = math.ceil(self._resumed.batches / self.args.gradient_accumulation_steps)
        epoch = self._resumed.epoch
        if self.args.max_steps > 0:
            epochs = epoch + 1 + max(0, math.ceil((max_steps - global_step - rest) / per_epoch))
        else:
            max_steps = global_step + rest + (epochs - epoch - 1) * per_epoch
        return epochs, per_epoch, examples, samples, total_batch, steps_in_epoch, max_steps

    def _already_positioned(self, dataloader: Any, num_batches: int = 0) -> Any:
        """Stands in for Accelerate's ``skip_first_batches`` in the resumed epoch: the loader is already there."""
        if dataloader is not self._train_loader or dataloader.batches_yielded != num_batches:
            raise StatefulLoaderError(
                f"the Trainer asked to skip {num_batches} batches of {type(dataloader).__name__}, but the restored "
                f"loader stands at batch {getattr(dataloader, 'batches_yielded', '?')}; this transformers "
                f"({transformers.__version__}) resumes differently from {SUPPORTED_TRANSFORMERS}"
            )
        return dataloader

    def _clear_leftover(self, folder: Path) -> None:
        """Remove what a killed save left at ``folder``, unseal a complete checkpoint there, and mark it as this
        package's; a folder this package did not write is refused, never removed (``clear_leftover``)."""
        clear_leftover(DistContext.detect(), folder)


def _no_rotation(*args: Any, **kwargs: Any) -> None:
    """Rotation waits until the new checkpoint is complete (see ``StatefulTrainerMixin._save_checkpoint``)."""


def _length(loader: Any) -> Optional[int]:
    try:
        return len(loader)
    except TypeError:
        return None


class StatefulTrainer(StatefulTrainerMixin, Trainer):
    """A ``transformers.Trainer`` whose ``train(resume_from_checkpoint=True)`` resumes the data exactly.

    - Trains with :class:`accelerate_stateful.Accelerator` and ``use_stateful_dataloader=True``.
    - Every ``checkpoint-N`` holds every rank's loader state and a manifest written last; only a
      checkpoint with a valid manifest is ever resumed from.
    - ``resume_from_checkpoint=True``: the newest complete checkpoint, or a fresh start when there is none.
    - On resume the loader continues where it stood and the Trainer skips nothing (no batch is read to
      be thrown away); same number of processes: the run continues as the uninterrupted one would.
    - On SIGTERM or SIGUSR1 (``preemption_signals``; pass ``()`` to turn it off) every rank saves
      ``checkpoint-N`` at the next optimizer step and the process exits with status 143.

    Examples:
        >>> trainer = StatefulTrainer(model=model, args=TrainingArguments("out", save_steps=50),  # doctest: +SKIP
        ...                           train_dataset=ds)
        >>> trainer.train(resume_from_checkpoint=True)                                          # doctest: +SKIP
    """


_STATEFUL_CLASSES: dict[type, type] = {Trainer: StatefulTrainer}


def stateful(trainer_class: type) -> type:
    """A subclass of ``trainer_class`` (any ``transformers.Trainer`` subclass, e.g. TRL's ``SFTTrainer``) that
    resumes exactly, like :class:`StatefulTrainer`.

    Examples:
        >>> from trl import SFTTrainer                                                     # doctest: +SKIP
        >>> trainer = stateful(SFTTrainer)(model=model, args=config, train_dataset=ds)     # doctest: +SKIP
    """
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise TypeError(f"stateful() takes a transformers.Trainer subclass, got {trainer_class!r}")
    if issubclass(trainer_class, StatefulTrainerMixin):
        return trainer_class
    if trainer_class not in _STATEFUL_CLASSES:
        _STATEFUL_CLASSES[trainer_class] = type(
            f"Stateful{trainer_class.__name__}", (StatefulTrainerMixin, trainer_class),
            {"__module__": __name__, "__doc__": f"{trainer_class.__name__} that resumes exactly (see stateful())."},
        )
    return _STATEFUL_CLASSES[trainer_class]


__all__ = ["PREEMPTED_EXIT_CODE", "StatefulTrainer", "StatefulTrainerMixin", "check_transformers",
           "checkpoint_step", "latest_trainer_checkpoint", "stateful"]
PREEMPTED_EXIT_CODE = _preemption.PREEMPTED_EXIT_CODE
