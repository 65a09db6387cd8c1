"""Accelerate's own tests, run with this package's ``Accelerator`` (``tools/accelerate_conformance.py``).

Copied next to the test files of Accelerate's source distribution, this file replaces ``accelerate.Accelerator``
(and ``accelerate.accelerator.Accelerator``) before the test modules import it, with this package's
``Accelerator``, with ``use_stateful_dataloader=True`` where a test passes no ``DataLoaderConfiguration``
(a test that passes one gets exactly what it asks for): every loader those tests prepare is one of ours.

One kind of assert is set aside, since composition is the design (docs/STYLE: the adapter holds the base
loader, it never fakes ``__class__``): ``isinstance(prepared_loader, StatefulDataLoader)`` in
``test_accelerator.py``. There, the name ``StatefulDataLoader`` is bound to a type whose ``isinstance``
also accepts this package's loaders; everything else the tests assert is unchanged.
"""

from __future__ import annotations

import accelerate
import accelerate.accelerator
from accelerate.utils import DataLoaderConfiguration
from torchdata.stateful_dataloader import StatefulDataLoader

import accelerate_stateful
from accelerate_stateful.loaders._adapter import DataLoaderAdapter
from accelerate_stateful.loaders.skip import SkipDataLoader


class StatefulAccelerator(accelerate_stateful.Accelerator):
    """This package's ``Accelerator``; stateful loaders unless the test's own configuration says otherwise."""

    def __init__(self, *args, dataloader_config: DataLoaderConfiguration | None = None, **kwargs) -> None:
        if dataloader_config is None:
            dataloader_config = DataLoaderConfiguration(use_stateful_dataloader=True)
        super().__init__(*args, dataloader_config=dataloader_config, **kwargs)


class _StatefulOrOurs(type):
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, (StatefulDataLoader, DataLoaderAdapter, SkipDataLoader))


class StatefulDataLoaderOrOurs(metaclass=_StatefulOrOurs):
    """Stands for ``StatefulDataLoader`` in ``isinstance`` checks of ``test_accelerator.py`` only."""


accelerate.Accelerator = StatefulAccelerator
accelerate.accelerator.Accelerator = StatefulAccelerator


def pytest_collection_modifyitems(config, items) -> None:
    """Check that the substitution took, and set the one kind of assert aside (see the module docstring)."""
    for item in items:
        module = item.module
        for name in ("Accelerator",):
            if getattr(module, name, StatefulAccelerator) is not StatefulAccelerator:
                raise RuntimeError(f"{module.__name__}.{name} is not this package's Accelerator")
        if module.__name__.endswith("test_accelerator") and hasattr(module, "StatefulDataLoader"):
            module.StatefulDataLoader = StatefulDataLoaderOrOurs
