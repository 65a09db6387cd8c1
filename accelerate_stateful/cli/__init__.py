"""The accelerate-stateful command line: inspect, verify, samples, diff (``python -m accelerate_stateful``)."""

from ._main import main

__all__ = ["main"]
