"""The `patchgrid` command line. Input is validated here; the library takes plain values. The
options of the settings (patchgrid.settings) are generated from their declarations (options.py);
each command group is a module of its own:

    common.py     the usage error, positions, a model's tokenizer
    options.py    options from the settings' declarations
    pair.py       patch, paths and the demo's one-pair sweep
    data.py       models prepare, pairs check, sweep
    study.py      study, serve, the demo's study
    warehouse.py  report, query
    supervise.py  the command, run as a process, in a child of its own (stop signals, what is left)

Importing this package is light (the parser, which imports the library, is imported on first use), so
that the supervisor of a command run as a process holds no engine, torch or Prefect.
"""
from __future__ import annotations

import importlib
import signal
import sys

from .common import UsageError

__all__ = ["DEFAULT_STUDY", "UsageError", "build_parser", "main"]


def __getattr__(name: str):
    if name in ("DEFAULT_STUDY", "build_parser"):
        return getattr(importlib.import_module(".parser", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv=None) -> int:
    """The command line `argv` (a list), run in this process; or (None) this process's own, which a command that
    starts engines, flows or servers runs in a child it supervises (supervise.py)."""
    if argv is not None:
        return _main(argv)
    from .supervise import exit_unfinalized, supervise, wanted

    if wanted(sys.argv[1:]):
        return supervise(sys.argv[1:])
    code = 1  # an exception's, unless the command returns or exits
    exit_unfinalized(lambda: code)
    from ..runtime.stopping import process_ends_with_command

    process_ends_with_command()
    try:
        code = _main(None)
    except SystemExit as exc:  # --help, a usage error
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        raise
    return code


def _main(argv) -> int:
    from ..runtime.console import quiet_engine_logs
    from .parser import build_parser

    args = build_parser().parse_args(argv)
    quiet_engine_logs()
    from ..runtime.stopping import Cancelled, cancel_on_signals, one_line, signalled

    try:
        with cancel_on_signals():
            try:
                return args.func(args)
            except Exception:
                if signalled():  # the signal's exception was replaced on its way out
                    raise Cancelled(signalled()) from None
                raise
    # ModelError, PairError, PlanError, SourceError, SpecError, RowError and WarehouseError are
    # ValueErrors: each names what is wrong in the user's input.
    except (UsageError, ValueError, OSError) as exc:
        text = " ".join(str(exc).split())  # one line, whatever the library wrote
        print(f"patchgrid: error: {text}", file=sys.stderr)
        return 2
    except (Cancelled, KeyboardInterrupt) as exc:
        signame = exc.signame if isinstance(exc, Cancelled) else "SIGINT"
        print(f"patchgrid: stopped by {signame}; a running study is recorded as cancelled", file=sys.stderr)
        return 128 + int(getattr(signal, signame))
    except Exception as exc:
        if getattr(args, "verbose", False):
            raise
        print(f"patchgrid: error: {' '.join(one_line(exc).split())} (--verbose shows the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
