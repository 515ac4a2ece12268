"""`python -m lmforge.train CONFIG [KEY=VALUE ...] [--out DIR] [--resume]`; also the torchrun entry point.

A torchrun rank ends with `os._exit` once its run has returned (its process group left, its files written and
closed, its streams and logs flushed): the interpreter's own teardown could still abort a finished rank with
SIGABRT ("terminate called without an active exception", a C++ thread of the collectives' runtime destroyed at
exit), which fails the whole launch (twice in full suite runs, 2026-12-06, after `fit_then_leave` had left the
process group)."""

import logging
import os
import sys

from lmforge.train.commands import train_app


def _rank_main() -> None:
    code: int = 0
    try:
        train_app()
    except SystemExit as e:  # typer ends every command with one
        if isinstance(e.code, int):
            code = e.code
        elif e.code is not None:  # a message: print it as sys.exit would
            print(e.code, file=sys.stderr)
            code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a torchrun rank
        _rank_main()
    train_app()
