"""Accelerator: a drop-in ``accelerate.Accelerator`` whose loaders resume exactly."""

from __future__ import annotations

import contextlib
import logging
import shutil
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import accelerate
from torch.utils.data import DataLoader, IterableDataset

from . import _files, _refusals, _training
from . import _state as S
from ._agreement import agree_after_elastic_load
from ._adapter import DataLoaderAdapter
from ._context import DistContext
from .errors import CheckpointError, UnsupportedConfigError
from .dispatch import DispatchDataLoader
from .iterable import IterableShardDataLoader
from .roundrobin import RoundRobinDataset, RoundRobinLoader
from .shard import ShardDataLoader
from .skip import SkipDataLoader

logger = logging.getLogger(__name__)

PathLike = Union[str, Path]


class Accelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` whose prepared loaders keep their position in every checkpoint.

    With ``DataLoaderConfiguration(use_stateful_dataloader=True)``, ``prepare``
    returns this package's loaders, ``save_state`` writes each loader's position
    for every rank inside the checkpoint (plus a manifest, written last, that
    marks it complete), and ``resume()`` continues from the newest complete
    checkpoint. With the option off, it behaves exactly as Accelerate's.

    Example:
        >>> from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
        >>> accelerator = Accelerator(                                    # doctest: +SKIP
        ...     dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
        ...     project_config=ProjectConfiguration(project_dir="runs/x", automatic_checkpoint_naming=True),
        ... )
        >>> model, optimizer, dl = accelerator.prepare(model, optimizer, dl)   # doctest: +SKIP
        >>> accelerator.resume()                                          # doctest: +SKIP
    """

    # ----------------------------------------------------------------- prepare
    def prepare_data_loader(
        self, data_loader: DataLoader, device_placement: Optional[bool] = None, slice_fn_for_dispatch: Any = None
    ) -> Any:
        if not self.use_stateful_dataloader:
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        if isinstance(data_loader, (DataLoaderAdapter, SkipDataLoader)):
            loader = data_loader.loader if isinstance(data_loader, SkipDataLoader) else data_loader
            if loader not in self._dataloaders:
                self._dataloaders.append(loader)
            return data_loader
        if device_placement is None:
            device_placement = self.device_placement
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
        if dispatch:
            loader = DispatchDataLoader.from_dataloader(data_loader, ctx, slice_fn=slice_fn_for_dispatch, **common)
        elif isinstance(data_loader.dataset, RoundRobinDataset):
            loader = RoundRobinLoader.from_dataloader(data_loader, ctx, **common)
        elif isinstance(data_loader.dataset, IterableDataset):
            loader = IterableShardDataLoader.from_dataloader(data_loader, ctx, **common)
        else:
            loader = ShardDataLoader.from_dataloader(data_loader, ctx, even_batches=self.even_batches, **common)
        self._dataloaders.append(loader)
        return loader

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """Skip the first ``num_batches`` of the epoch by moving the position, not by reading them."""
        if isinstance(dataloader, SkipDataLoader):
            dataloader = dataloader.loader
        if isinstance(dataloader, DataLoaderAdapter):
            return SkipDataLoader(dataloader, num_batches)
        return super().skip_first_batches(dataloader, num_batches)

    def backward(self, loss: Any, **kwargs: Any) -> None:
        """Accelerate's ``backward``; also marks that the model was trained while the live passes ran."""
        _training.note_trained()
        return super().backward(loss, **kwargs)

    # ----------------------------------------------------------------- checkpoints
    @property
    def stateful_loaders(self) -> list[DataLoaderAdapter]:
        """The prepared loaders whose positions ``save_state`` records, in preparation order."""
        return [dl for dl in self._dataloaders if isinstance(dl, DataLoaderAdapter)]

    def save_state(self, output_dir: Optional[PathLike] = None, safe_serialization: bool = True, **kwargs: Any):
        """Accelerate's ``save_state`` plus every loader's position, then a manifest marking it complete.

        Old checkpoints beyond ``total_limit`` are removed only after the new one is complete.
        """
        if not self.use_stateful_dataloader:
            return super().save_state(output_dir, safe_serialization, **kwargs)
        config = self.project_configuration
        root = self._checkpoint_root() if config.automatic_checkpoint_naming else None
        if root is not None:
            output_dir = root / f"checkpoint_{config.iteration}"
            self._clear_unfinished(output_dir)
        elif output_dir is None:
            raise ValueError("save_state() needs an output_dir when automatic_checkpoint_naming is off")
        output_dir = Path(output_dir)
        loaders = self.stateful_loaders
        states = [loader.state_dict() for loader in loaders]
        with self._accelerate_view():
            super().save_state(str(output_dir), safe_serialization, **kwargs)
        for index, state in enumerate(states):
            _files.write_loader_state(output_dir, index, self.process_index, state)
        self.wait_for_everyone()
        if self.is_main_process:
            _files.write_manifest(output_dir, world_size=self.num_processes, num_loaders=len(loaders))
            if root is not None and config.total_limit is not None:
                _rotate(root, keep=config.total_limit)
        self.wait_for_everyone()
        return output_dir

    def load_state(self, input_dir: Optional[PathLike] = None, load_kwargs: Optional[dict] = None, **kwargs: Any):
        """Accelerate's ``load_state``, refusing incomplete checkpoints and restoring every loader's position.

        Every loader state is read and validated before anything is loaded.
        """
        if not self.use_stateful_dataloader:
            return super().load_state(input_dir, load_kwargs, **kwargs)
        if input_dir is None:
            if not self.project_configuration.automatic_checkpoint_naming:
                raise ValueError("load_state() needs an input_dir when automatic_checkpoint_naming is off")
            input_dir = self._agreed_latest(self._checkpoint_root())
            if input_dir is None:
                raise CheckpointError(f"no complete checkpoint under {self._checkpoint_root()}")
        input_dir = Path(input_dir)
        states = self._read_loader_states(input_dir)
        with self._accelerate_view():
            super().load_state(str(input_dir), load_kwargs, **kwargs)
        saved_world = _files.read_manifest(input_dir)["world_size"]
        if saved_world != self.num_processes:
            agree_after_elastic_load(self, saved_world, input_dir)
        for loader, state in zip(self.stateful_loaders, states):
            loader.load_state_dict(state)
        if self.is_main_process:
            for index, (loader, state) in enumerate(zip(self.stateful_loaders, states)):
                _log_resume(index, loader, state, input_dir)

    def resume(self, checkpoint_root: Optional[PathLike] = None) -> Optional[Path]:
        """Load the newest complete checkpoint; returns its path, or ``None`` when there is none.

        Args:
            checkpoint_root: The folder holding ``checkpoint_<N>`` folders; defaults to
                ``<project_dir>/checkpoints`` with ``automatic_checkpoint_naming``.

        The next ``save_state`` continues the numbering after the loaded checkpoint.
        """
        if not self.use_stateful_dataloader:
            raise UnsupportedConfigError(
                "resume() needs DataLoaderConfiguration(use_stateful_dataloader=True): only then does "
                "save_state() mark checkpoints complete"
            )
        if checkpoint_root is None:
            if not self.project_configuration.automatic_checkpoint_naming:
                raise ValueError(
                    "resume() needs checkpoint_root=... when ProjectConfiguration(automatic_checkpoint_naming=True) "
                    "is not set"
                )
            checkpoint_root = self._checkpoint_root()
        path = self._agreed_latest(Path(checkpoint_root))
        if path is None:
            return None
        self.load_state(path)
        number = _files.checkpoint_number(path)
        if number is not None and self.project_configuration.automatic_checkpoint_naming:
            self.project_configuration.iteration = number + 1
        return path

    # ----------------------------------------------------------------- internals
    def _checkpoint_root(self) -> Path:
        return Path(self.project_dir) / "checkpoints"

    def _agreed_latest(self, root: Path) -> Optional[Path]:
        """The newest complete checkpoint as the main process sees it, on every rank."""
        latest = _files.latest_checkpoint(root) if self.is_main_process else None
        agreed = DistContext.detect().broadcast(None if latest is None else str(latest))
        return None if agreed is None else Path(agreed)

    def _clear_unfinished(self, output_dir: Path) -> None:
        """Remove a leftover of a save that was killed before its manifest; refuse to overwrite a complete one."""
        if output_dir.exists() and _files.is_complete(output_dir):
            raise CheckpointError(
                f"{output_dir} already holds a complete checkpoint; call resume() first so numbering continues "
                "after it, or set project_configuration.iteration"
            )
        if self.is_main_process and output_dir.exists():
            logger.warning("removing %s: an unfinished save (no valid manifest)", output_dir)
            shutil.rmtree(output_dir)
        self.wait_for_everyone()

    def _read_loader_states(self, checkpoint: Path) -> list[Any]:
        """This rank's state of every loader, read and validated before anything is loaded.

        On another number of processes (elastic resume), every rank takes the main process's state, after
        checking that all saved ranks agree on the position; each loader then re-derives its own cursor or
        refuses with the reason.
        """
        manifest = _files.read_manifest(checkpoint)
        loaders = self.stateful_loaders
        if manifest["num_loaders"] != len(loaders):
            raise CheckpointError(
                f"{checkpoint} holds {manifest['num_loaders']} loader states, this run prepared {len(loaders)} "
                "stateful loaders; prepare the same loaders in the same order as the run that saved it"
            )
        saved_world = manifest["world_size"]
        states = []
        for index, loader in enumerate(loaders):
            rank = self.process_index if saved_world == self.num_processes else 0
            source = str(_files.state_file(checkpoint, index, rank))
            state = _files.read_loader_state(checkpoint, index, rank)
            S.check_shape(state, source)
            written = state[S.TOPOLOGY].get("world_size")
            if written != saved_world:
                raise CheckpointError(
                    f"{source} was written by world_size={written}, but "
                    f"{Path(checkpoint) / _files.SUBDIR / _files.MANIFEST} says world_size={saved_world}; the "
                    "checkpoint mixes files of different runs, resume from another checkpoint"
                )
            if loader.needs_all_ranks(state):
                every = [state if r == rank else _files.read_loader_state(checkpoint, index, r)
                         for r in range(saved_world)]
                for r, other in enumerate(every):
                    S.check_shape(other, str(_files.state_file(checkpoint, index, r)))
                state = loader.merge_rank_states(every)
            states.append(state)
        refusal = _refusals.order_refusal(
            states, lambda i, j: _refusals.fits(loaders[j], states[i]), lambda j: _refusals.describe(loaders[j]),
            checkpoint,
        )
        if refusal is not None:
            raise refusal
        for index, (loader, state) in enumerate(zip(loaders, states)):
            rank = self.process_index if saved_world == self.num_processes else 0
            loader.validate_state(state, source=str(_files.state_file(checkpoint, index, rank)))
        return states

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


def _log_resume(index: int, loader: DataLoaderAdapter, state: dict, source: Path) -> None:
    """One line saying where the loader resumes, and the change of topology it handles."""
    done = loader.progress()
    progress = f"batch {loader.batches_yielded}" if done is None else f"{100 * done:.1f}%"
    now = f"{loader.ctx.world_size} ranks x {loader.num_workers} workers"
    saved = state["topology"]
    was = f"{saved.get('world_size')} x {saved.get('num_workers')}"
    if was == f"{loader.ctx.world_size} x {loader.num_workers}":
        logger.info("loader %d: resuming epoch %d at %s on %s (%s)", index, loader.epoch, progress, now, source)
    else:
        logger.warning(
            "loader %d: resuming epoch %d at %s on %s (was %s) from %s", index, loader.epoch, progress, now, was, source
        )


def _rotate(root: Path, keep: int) -> None:
    """Keep the ``keep`` newest complete checkpoints; drop older ones and unfinished leftovers older than those."""
    numbered = _files.numbered_checkpoints(root)
    complete = [p for p in numbered if _files.is_complete(p)]
    if not complete:
        return
    kept = set(complete[: max(keep, 1)])
    oldest_kept = min(_files.checkpoint_number(p) for p in kept)
    for path in numbered:
        if path not in kept and _files.checkpoint_number(path) < oldest_kept:
            shutil.rmtree(path, ignore_errors=False)
