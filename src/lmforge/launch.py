"""The `lmforge` command's entry point, one step before the CLI (`lmforge.cli`).

`lmforge serve MODEL` runs its engine in a child process by default, and that child spends ~1.5 s importing
torch before it can load anything. The CLI itself imports torch too (its verbs' modules), so the child is
started here, first, and both import side by side on two cores; `serve` sends the child its model as soon as
the flags are read (`engine.spawn`). Every other verb goes straight to the CLI.
"""

from __future__ import annotations

import gc
import sys

# flags after which `serve` runs no engine child of its own (in-process engine, Ray replicas) or asks nothing
_NO_CHILD = ("--help", "--no-engine-process", "--replicas", "--ray-address")


def wants_engine_child(args: list[str]) -> bool:
    """Whether these command-line arguments start `lmforge serve` with its engine in a child process."""
    return bool(args) and args[0] == "serve" and not any(a.split("=", 1)[0] in _NO_CHILD for a in args[1:])


def main() -> None:
    if wants_engine_child(sys.argv[1:]):
        gc.disable()  # a start without full collections over the imports (`tools.procs.startup_done` ends it)
        from lmforge.engine.spawn import prespawn  # imports no torch (lmforge.engine loads its names lazily)

        prespawn()
    from lmforge.cli import main as cli_main

    cli_main()


if __name__ == "__main__":  # `python -m lmforge.launch serve ...`: what the `lmforge` script runs
    main()
