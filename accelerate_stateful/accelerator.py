"""Accelerator: a drop-in ``accelerate.Accelerator`` whose loaders resume exactly."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import accelerate
from accelerate.utils import DistributedType
from torch.utils.data import DataLoader, IterableDataset

from .checkpoint import _lines
from . import _log
from . import _teardown
from .training import _accumulation
from .checkpoint import _checkpoints
from .checkpoint import _files
from .checkpoint import _in_step
from .checkpoint import _pending
from .training import _preemption
from .training import _record_switch
from .training import _record
from .training._check_workers import with_checker_workers
from .checkpoint import _resume
from .checkpoint import _stock
from .training import _rng
from .training import _training
from .training._agreement import agree_after_elastic_load
from .loaders import _putback, _untracked
from .loaders._adapter import DataLoaderAdapter
from ._context import DistContext
from .loaders.batchsampler import BatchSamplerDataLoader, uses_batch_sampler
from .errors import CheckpointError, LifecycleError, UnsupportedConfigError
from .loaders.dispatch import DispatchDataLoader
from .loaders.iterable import IterableShardDataLoader
from .sources.indexed import Indexed, stream_library
from .sources.roundrobin import RoundRobinDataset, RoundRobinLoader
from .loaders.shard import ShardDataLoader, loader_settings
from .loaders.skip import SkipDataLoader

logger = _log.main_process_logger(__name__)

PathLike = Union[str, Path]


class Accelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` whose prepared loaders keep their position in every checkpoint.

    With ``DataLoaderConfiguration(use_stateful_dataloader=True)``, ``prepare``
    returns this package's loaders, ``save_state`` writes each loader's position
    for every rank inside the checkpoint (plus a manifest, written last, that
    marks it complete), and ``resume()`` continues from the newest complete
    checkpoint. With the option off, it behaves exactly as Accelerate's.

    Examples:
        >>> from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
        >>> accelerator = Accelerator(                                    # doctest: +SKIP
        ...     dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
        ...     project_config=ProjectConfiguration(project_dir="runs/x", automatic_checkpoint_naming=True),
        ... )
        >>> model, optimizer, dl = accelerator.prepare(model, optimizer, dl)   # doctest: +SKIP
        >>> accelerator.resume()                                          # doctest: +SKIP

    Args:
        pipeline_rng: How randomness drawn in a map-style dataset's ``__getitem__`` is reproduced after a
            resume: ``"auto"`` (default: seeded per batch in workers), ``"batch"``, ``"sample"`` or ``"off"``;
            see ``docs/exactness.md``.
        carry_gradients: Save the partial gradient of an accumulation window (each rank's ``.grad``, or the
            states FSDP2 keeps) in every checkpoint taken inside one, and restore it on load (default); a save
            inside a window where the framework keeps it out of reach (DeepSpeed ZeRO-2/3, some ZeRO-1 setups,
            FSDP1) is refused.
            ``False`` writes none and refuses nothing.
        *args: Positional arguments of ``accelerate.Accelerator``.
        **kwargs: Everything else ``accelerate.Accelerator`` accepts.
    """

    def __init__(self, *args: Any, pipeline_rng: str = "auto", carry_gradients: bool = True, **kwargs: Any) -> None:
        _rng.check_mode(pipeline_rng)
        self.pipeline_rng = pipeline_rng
        self.carry_gradients = carry_gradients
        self._preemption_requests: list[_preemption.StepEndCheckpoint] = []
        self._untracked_seen = _training.untracked_events()  # training on unprepared loaders: said once
        self._pending = _pending.Pending()  # saved states of loaders not prepared yet (prepared after a load)
        super().__init__(*args, **kwargs)
        _record.start(self)  # only under `accelerate-stateful check-resume`

    # ----------------------------------------------------------------- prepare
    def prepare(self, *args: Any, device_placement: Optional[list] = None) -> Any:
        """Accelerate's ``prepare``; refused under Megatron-LM, whose path would bypass this package."""
        if self.use_stateful_dataloader and self.distributed_type == DistributedType.MEGATRON_LM:
            raise UnsupportedConfigError(
                "accelerate-stateful cannot resume data under Megatron-LM: Accelerate prepares its data loaders "
                "with its own Megatron path (and reads a batch while preparing), so no position would be saved; "
                "train with DDP, FSDP2 or DeepSpeed, or pass DataLoaderConfiguration(use_stateful_dataloader=False) "
                "to use Accelerate's own loaders"
            )
        return super().prepare(*args, device_placement=device_placement)

    def prepare_data_loader(
        self, data_loader: DataLoader, device_placement: Optional[bool] = None, slice_fn_for_dispatch: Any = None
    ) -> Any:
        if not self.use_stateful_dataloader:
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        if isinstance(data_loader, (DataLoaderAdapter, SkipDataLoader)):
            loader = data_loader.loader if isinstance(data_loader, SkipDataLoader) else data_loader
            if loader not in self._dataloaders:
                self._register(loader)
            return data_loader
        if device_placement is None:
            device_placement = self.device_placement
        data_loader = with_checker_workers(data_loader)  # only under `accelerate-stateful check-resume --workers`
        data_loader = read_by_index(data_loader)  # a streaming dataset's IterableDataset-ness must not decide
        dispatch = self.dispatch_batches
        if dispatch is None:
            dispatch = device_placement and isinstance(data_loader.dataset, IterableDataset)
        common = {
            "device": self.device if device_placement else None,
            "non_blocking": self.non_blocking,
            "split_batches": self.split_batches,
            "data_seed": self.dataloader_config.data_seed,
        }
        ctx = DistContext.detect()
        if _untracked.leave_to_accelerate(data_loader, ctx, dispatch):
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        if dispatch:
            loader = DispatchDataLoader.from_dataloader(data_loader, ctx, slice_fn=slice_fn_for_dispatch,
                                                        pipeline_rng=self.pipeline_rng, **common)
        elif isinstance(data_loader.dataset, RoundRobinDataset):
            loader = RoundRobinLoader.from_dataloader(data_loader, ctx, **common)
        elif isinstance(data_loader.dataset, IterableDataset):
            loader = IterableShardDataLoader.from_dataloader(data_loader, ctx, **common)
        elif uses_batch_sampler(data_loader):
            loader = BatchSamplerDataLoader.from_dataloader(data_loader, ctx, even_batches=self.even_batches,
                                                            pipeline_rng=self.pipeline_rng, **common)
        else:
            loader = ShardDataLoader.from_dataloader(
                data_loader, ctx, even_batches=self.even_batches, pipeline_rng=self.pipeline_rng,
                use_seedable_sampler=self.dataloader_config.use_seedable_sampler, **common
            )
        self._register(loader)
        return loader

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """Skip the first ``num_batches`` of the epoch by moving the position, not by reading them."""
        if isinstance(dataloader, SkipDataLoader):
            dataloader = dataloader.loader
        if isinstance(dataloader, DataLoaderAdapter):
            return SkipDataLoader(dataloader, num_batches)
        return super().skip_first_batches(dataloader, num_batches)

    def prepare_optimizer(self, optimizer: Any, device_placement: Optional[bool] = None) -> Any:
        """Accelerate's ``prepare_optimizer``; under ``check-resume`` the first one's steps are recorded."""
        prepared = super().prepare_optimizer(optimizer, device_placement=device_placement)
        if _record_switch.active is not None:
            _record_switch.active.watch(prepared.optimizer)
        return prepared

    def prepare_model(self, model: Any, device_placement: Optional[bool] = None, evaluation_mode: bool = False):
        """Accelerate's ``prepare_model``; a backward pass that reaches the model's parameters counts as training."""
        prepared = super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        if self.use_stateful_dataloader:
            _training.watch(model)
        return prepared

    def backward(self, loss: Any, **kwargs: Any) -> None:
        """Accelerate's ``backward``; also marks that the model was trained while the live passes ran."""
        _training.note_trained(backward=True)
        if _record_switch.active is not None:
            _record_switch.active.loss(loss)
        return super().backward(loss, **kwargs)

    # ----------------------------------------------------------------- checkpoints
    @property
    def stateful_loaders(self) -> list[DataLoaderAdapter]:
        """The prepared loaders whose positions ``save_state`` records, in preparation order."""
        return [dl for dl in self._dataloaders if isinstance(dl, DataLoaderAdapter)]

    def save_state(self, output_dir: Optional[PathLike] = None, safe_serialization: bool = True, **kwargs: Any):
        """Accelerate's ``save_state`` plus every loader's position, then a manifest marking it complete.

        Call it on every process. With automatic naming the number continues after the newest checkpoint
        present; old checkpoints beyond ``total_limit`` are removed only after the new one is complete,
        and never the new one.
        """
        if not self.use_stateful_dataloader:
            return super().save_state(output_dir, safe_serialization, **kwargs)
        ctx = DistContext.detect()
        _checkpoints.enter(ctx, "save_state")
        _in_step.settle(ctx, self.stateful_loaders, "accelerator.save_state()")
        unprepared = _checkpoints.agree(ctx, lambda: self._pending.carried(ctx))  # saved for loaders not prepared yet
        carry = _accumulation.take(ctx, self)
        config = self.project_configuration
        root = self._checkpoint_root() if config.automatic_checkpoint_naming else None
        output_dir, number = _checkpoints.destination(ctx, root, output_dir, config.iteration)
        loaders = self.stateful_loaders
        contents = _checkpoints.agree(
            ctx, lambda: [_files.encode_state(state) for state in
                          _putback.checkpoint_states(ctx, loaders, "accelerator.save_state()") + unprepared])

        def accelerate_save() -> None:
            with self._accelerate_view():
                super(Accelerator, self).save_state(str(output_dir), safe_serialization, **kwargs)

        _checkpoints.agree(ctx, accelerate_save)
        if _record_switch.active is not None:  # before the seal: check-resume's kill "inside the save" lands here
            _record_switch.active.saving(output_dir)
        entries = _checkpoints.agree(ctx, lambda: {
            rel: entry for index, content in enumerate(contents)
            for rel, entry in _files.write_encoded(output_dir, index, self.process_index, content).items()
        })
        if carry is not None:
            grads = _checkpoints.agree(
                ctx, lambda: _accumulation.write_gradients(output_dir, self.process_index, carry))
            if grads is not None:
                entries[grads.relative_to(output_dir).as_posix()] = _files.file_entry(grads)
        _checkpoints.seal(ctx, output_dir, num_loaders=len(contents), entries=entries, root=root,
                          keep=config.total_limit)
        line = carry and _accumulation.size_line(carry.sizes, output_dir)
        if line:
            logger.warning(line)
        self._say_untracked_training(output_dir)
        if number is not None:
            config.iteration = number + 1
        return output_dir

    def load_state(self, input_dir: Optional[PathLike] = None, load_kwargs: Optional[dict] = None, **kwargs: Any):
        """Accelerate's ``load_state``, refusing incomplete checkpoints and restoring every loader's position.

        Call it on every process. Every loader state is read and validated before anything is loaded.
        """
        if not self.use_stateful_dataloader:
            return super().load_state(input_dir, load_kwargs, **kwargs)
        ctx = DistContext.detect()
        _checkpoints.enter(ctx, "load_state")
        self._ready_to_load(ctx, "accelerator.load_state()")
        root = self._checkpoint_root() if self.project_configuration.automatic_checkpoint_naming else None
        if _stock.agreed_is_stock(ctx, input_dir):
            found = (Path(input_dir), None)
        elif _checkpoints.same_everywhere(ctx, input_dir is None and root is not None, "load_state()'s input_dir"):
            found = _stock.newest_to_resume(ctx, root)
            if found is None:
                raise CheckpointError(f"no complete checkpoint under {root}")
        else:
            found = _resume.locate(ctx, input_dir, root)
        if found[1] is None:
            self._load_stock(ctx, found[0], load_kwargs, **kwargs)
        else:
            self._load_verified(*found, load_kwargs, **kwargs)

    def resume(self, checkpoint_root: Optional[PathLike] = None) -> Optional[Path]:
        """Load the newest checkpoint complete on every process; returns its path, or ``None`` when there is none.

        Args:
            checkpoint_root: The folder holding ``checkpoint_<N>`` folders; defaults to
                ``<project_dir>/checkpoints`` with ``automatic_checkpoint_naming``.

        Call it on every process, after ``prepare``. The next ``save_state`` continues the numbering after
        the newest checkpoint present. A newer checkpoint of stock ``accelerate.Accelerator`` (a project that
        switched over) is resumed as Accelerate would, its loader positions translated, and left as it is
        (``docs/switching.md``).
        """
        if not self.use_stateful_dataloader:
            raise UnsupportedConfigError(
                "resume() needs DataLoaderConfiguration(use_stateful_dataloader=True): only then does "
                "save_state() mark checkpoints complete"
            )
        ctx = DistContext.detect()
        _checkpoints.enter(ctx, "resume")
        _checkpoints.agree(ctx, self._refuse_before_prepare)

        def root() -> Path:
            if checkpoint_root is None and not self.project_configuration.automatic_checkpoint_naming:
                raise ValueError(
                    "resume() needs checkpoint_root=... when ProjectConfiguration(automatic_checkpoint_naming=True) "
                    "is not set"
                )
            return Path(checkpoint_root) if checkpoint_root is not None else self._checkpoint_root()

        self._ready_to_load(ctx, "accelerator.resume()")
        folder = _checkpoints.agree(ctx, root)
        found = _stock.newest_to_resume(ctx, folder)
        if found is None:
            for loader in self.stateful_loaders:
                loader._anchor()
            logger.warning(_lines.fresh_start_line(folder, "resume(checkpoint_root=...)" if checkpoint_root is not None
                                                    else "ProjectConfiguration(project_dir=...)"))
            return None
        if found[1] is None:
            self._load_stock(ctx, found[0])
        else:
            self._load_verified(*found)
        return found[0]

    def end_training(self) -> None:
        """Accelerate's ``end_training``, once the process group's threads are idle (see ``_teardown``):
        destroying it while one of them waits for the GIL hangs the process at its exit."""
        _teardown.settle()
        super().end_training()

    def checkpoint_on_preemption(self, *loaders: DataLoaderAdapter, signals=_preemption.PREEMPTION_SIGNALS):
        """On SIGTERM or SIGUSR1, save a complete checkpoint at the end of an optimizer step on every rank and exit.

        Call it once, after ``prepare``. Once per step of the first prepared optimizer the ranks agree on whether
        any of them was signalled (one all-reduce, started at one step and read at the next, so it overlaps a
        step; never in a loader's ``next()``); then every rank calls ``save_state()`` at the end of that step,
        after the optimizer step and every prepared scheduler's ``step()``, and the process exits with status
        143 (``PREEMPTED_EXIT_CODE``). Running the same command (with ``resume()``) continues exactly.
        ``loaders`` (default: every prepared one) get workers that ignore the signals. See
        ``docs/trainer.md#preemption``.
        """
        checkpoint = _preemption.checkpoint_on_preemption(self, loaders or self.stateful_loaders, signals)
        self._preemption_requests.append(checkpoint)
        return checkpoint

    def free_memory(self, *objects: Any) -> list:
        """Accelerate's ``free_memory`` (alias ``clear``), and what this package tied to the prepared objects.

        The signal handlers of ``checkpoint_on_preemption`` give the signals back to their earlier handlers, and
        its hooks leave the prepared optimizer and schedulers. Nothing of this package then holds a prepared
        model, optimizer, scheduler or loader: each is freed when the program drops its last reference
        (``docs/lifecycle.md#freeing-memory-between-runs``).
        """
        for request in self._preemption_requests:
            request.uninstall()
        self._preemption_requests = []
        self._pending = _pending.Pending()
        return super().free_memory(*objects)

    # ----------------------------------------------------------------- internals
    def _register(self, loader: DataLoaderAdapter) -> None:
        """Add a prepared loader, once it took the state the loaded checkpoint saved for it, if one waits."""
        index = len(self.stateful_loaders)
        given = self._pending.give(DistContext.detect(), loader, index)
        self._dataloaders.append(loader)
        if given is not None and self.is_main_process:
            _lines.log_resume(index, loader, *given)

    def _ready_to_load(self, ctx: DistContext, call: str) -> None:
        """Every rank's loaders at the same point and none iterating, or a refusal on every rank."""
        _in_step.settle(ctx, self.stateful_loaders, call)
        _in_step.refuse_live(ctx, self.stateful_loaders, call)

    def _say_untracked_training(self, output_dir: Path) -> None:
        """Once per run: the model was trained on batches no prepared loader handed out (``_lines``)."""
        if self._untracked_seen is None or _training.untracked_events() == self._untracked_seen:
            return
        self._untracked_seen = None
        if all(isinstance(dl, DataLoaderAdapter) for dl in self._dataloaders):  # else Accelerate's: said at prepare
            logger.warning(_lines.untracked_training_line(output_dir))

    def _refuse_before_prepare(self) -> None:
        if not (self._models or self._optimizers or self._schedulers or self._dataloaders):
            raise LifecycleError(
                "accelerator.resume() was called before accelerator.prepare(): nothing is prepared to restore "
                "into; call it after `model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)`"
            )

    def _load_stock(self, ctx: DistContext, folder: Path, load_kwargs: Optional[dict] = None, **kwargs: Any) -> Path:
        """Load a checkpoint of stock Accelerate through Accelerate's own ``load_state``, then place the loaders
        where its loader states say (``checkpoint/_stock.py``); the folder is left as it is."""
        loaders = self.stateful_loaders
        positions = _stock.check(ctx, folder, loaders)
        unnumbered = _stock.unnumbered(loaders)

        def accelerate_load() -> None:
            with self._accelerate_view():
                super(Accelerator, self).load_state(str(folder), load_kwargs, **kwargs)

        _checkpoints.agree(ctx, accelerate_load)
        self._pending.keep([])
        said = _checkpoints.agree(ctx, lambda: _stock.place(loaders, positions))
        number = _files.checkpoint_number(folder)
        config = self.project_configuration
        if number is not None and config.automatic_checkpoint_naming:
            config.iteration = max(config.iteration, number + 1)
        logger.warning(_stock.resume_line(folder, _stock.restored_parts(self), self.step, said, unnumbered,
                                          config.iteration))
        if _record_switch.active is not None:
            _record_switch.active.resumed(folder)
        return folder

    def _unwrapped_models(self) -> list:
        return [self.unwrap_model(model) for model in self._models]

    def _checkpoint_root(self) -> Path:
        return Path(self.project_dir) / "checkpoints"

    def _load_verified(self, checkpoint: Path, manifest: dict, load_kwargs: Optional[dict] = None,
                       **kwargs: Any) -> None:
        """Load a checkpoint whose manifest every rank holds and whose folder was verified.

        Everything this package reads, and the file Accelerate reads for one rank alone, is checked on every
        rank before anything is loaded; each step after that runs under ``agree``, so a failure on one rank
        raises the same error on every rank (docs/reliability.md#a-failure-on-one-rank).
        """
        ctx = DistContext.detect()
        loaders = self.stateful_loaders
        states = _resume.read_states(ctx, checkpoint, manifest, loaders)
        waiting = _pending.read(ctx, checkpoint, manifest, len(loaders))
        grads = _checkpoints.agree(ctx, lambda: _accumulation.read_gradients(
            checkpoint, manifest, self.process_index, self.num_processes, self._unwrapped_models()))
        _resume.check_accelerate_files(ctx, checkpoint, manifest)

        def accelerate_load() -> None:
            with self._accelerate_view():
                super(Accelerator, self).load_state(str(checkpoint), load_kwargs, **kwargs)

        def restore() -> None:
            for loader, state in zip(loaders, states):
                loader.load_state_dict(state)
            self._pending.keep(waiting)
            _accumulation.restore_gradients(grads, self._unwrapped_models())
            for index, (loader, state) in enumerate(zip(loaders, states)):
                _lines.log_resume(index, loader, state, checkpoint)  # the main process's line: once per run

        _checkpoints.agree(ctx, accelerate_load)
        if manifest["world_size"] != self.num_processes:
            agree_after_elastic_load(self, manifest["world_size"], checkpoint)
        _checkpoints.agree(ctx, restore)
        number = _files.checkpoint_number(checkpoint)
        if number is not None and self.project_configuration.automatic_checkpoint_naming:
            self.project_configuration.iteration = max(self.project_configuration.iteration, number + 1)
        if _record_switch.active is not None:
            _record_switch.active.resumed(checkpoint)

    @contextlib.contextmanager
    def _accelerate_view(self) -> Iterator[None]:
        """Accelerate's own save/load path, minus our loaders (their state is ours to write) and rotation."""
        config = self.project_configuration
        saved = self._dataloaders, config.automatic_checkpoint_naming
        self._dataloaders = [dl for dl in self._dataloaders if not isinstance(dl, DataLoaderAdapter)]
        config.automatic_checkpoint_naming = False
        try:
            yield
        finally:
            self._dataloaders, config.automatic_checkpoint_naming = saved


def read_by_index(data_loader: DataLoader) -> DataLoader:
    """The user's ``DataLoader``, rebuilt over ``Indexed(dataset)`` where its dataset is a bare streaming dataset
    (read in index order: the ``DataLoader`` of an ``IterableDataset`` takes no ``shuffle``); else unchanged."""
    if stream_library(data_loader.dataset) is None:
        return data_loader
    return DataLoader(Indexed(data_loader.dataset), batch_size=data_loader.batch_size, shuffle=False,
                      drop_last=data_loader.drop_last, **loader_settings(data_loader))
