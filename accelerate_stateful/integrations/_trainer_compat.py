"""What the Trainer integration relies on inside transformers, in one place, checked at construction.

The Trainer offers no override point for three of its steps, so the integration replaces three names of
``transformers.trainer`` while one of its own methods runs (:func:`swapped`) and overrides three private
methods. :func:`check_transformers` verifies all of them and, when a transformers release changes one,
refuses with the supported versions.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator

import transformers
import transformers.trainer as hf_trainer
from transformers import Trainer

from ..errors import UnsupportedConfigError

SUPPORTED_TRANSFORMERS = "transformers >= 5.3, < 6 (tested with 5.3, 5.23 and 5.24)"
# What this module relies on inside transformers.trainer, checked by check_transformers().
MODULE_NAMES = ("Accelerator", "skip_first_batches", "rotate_checkpoints")
PRIVATE_METHODS = {
    "_init_training_state": ("max_steps", "num_update_steps_per_epoch", "num_train_epochs",
                             "resume_from_checkpoint", "trial"),
    "_run_epoch": ("epoch", "train_dataloader", "steps_in_epoch", "num_update_steps_per_epoch",
                   "resume_from_checkpoint", "epochs_trained", "steps_trained_in_current_epoch"),
    "_save_checkpoint": ("model", "trial"),
    "_get_output_dir": ("trial",),
}


def check_transformers() -> None:
    """Raise ``UnsupportedConfigError`` if this transformers lacks what the integration relies on."""
    problems = [f"transformers.trainer.{name} is gone" for name in MODULE_NAMES if not hasattr(hf_trainer, name)]
    for method, params in PRIVATE_METHODS.items():
        found = getattr(Trainer, method, None)
        names = set(inspect.signature(found).parameters) if found is not None else set()
        missing = [p for p in params if p not in names]
        if found is None or missing:
            problems.append(f"Trainer.{method} {'is gone' if found is None else f'lacks {missing}'}")
    if problems:
        raise UnsupportedConfigError(
            f"accelerate_stateful.integrations.transformers supports {SUPPORTED_TRANSFORMERS}; this is transformers "
            f"{transformers.__version__}, where " + "; ".join(problems) + ". Install a supported version."
        )


@contextlib.contextmanager
def swapped(name: str, value: Any) -> Iterator[None]:
    """``transformers.trainer.<name>`` is ``value`` inside the block (the Trainer has no override point there)."""
    original = getattr(hf_trainer, name)
    setattr(hf_trainer, name, value)
    try:
        yield
    finally:
        setattr(hf_trainer, name, original)
