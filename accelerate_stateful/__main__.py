"""``python -m accelerate_stateful``: the ``accelerate-stateful`` command line (see ``docs/cli.md``)."""

from .cli._main import main

if __name__ == "__main__":
    raise SystemExit(main())
