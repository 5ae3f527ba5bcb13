"""How a study stops when asked to: SIGTERM (what Slurm and Kubernetes send first) and SIGINT
become a `Cancelled` exception in the main thread, so every `with` block and `finally` on the way
out runs (engines shut down, the run is recorded as cancelled, Prefect stops the server it
started) and the process exits by itself, leaving nothing behind.
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager


class Cancelled(BaseException):
    """The study was asked to stop. A BaseException, like KeyboardInterrupt: no `except Exception`
    on the way out swallows it."""

    def __init__(self, signame: str):
        super().__init__(f"cancelled by {signame}")
        self.signame = signame


# The signals this process has been sent, first first. The Cancelled exception a signal raises
# can be replaced on its way out (Prefect's engine, caught mid-way through setting up a task, raises
# its own error instead), so how a study ended is decided by this record, not by the exception.
_received: list[str] = []


# Whether this process ends with the command it runs (the command line's process, not a notebook's
# or a test's): a stopped command's clean-up may then leave to the exit what the exit frees anyway.
_process_ends_with_command = False


def process_ends_with_command() -> None:
    global _process_ends_with_command
    _process_ends_with_command = True


def stopped_for_good() -> bool:
    """A stop signal came, and this process ends once the command's clean-up is done."""
    return _process_ends_with_command and bool(_received)


_depth: list[None] = []  # the cancel_on_signals blocks open in the main thread

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # the signals that stop a study


def signalled() -> str | None:
    """The first stop signal this process received, by name, or None."""
    return _received[0] if _received else None


@contextmanager
def cancel_on_signals():
    """Within the block, the first SIGTERM or SIGINT raises Cancelled; later ones are ignored, so
    that the clean-up they interrupt still finishes. Outside the main thread (where Python cannot
    take signals) this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if not _depth:  # a new command or study in this process (a notebook's next cell): no stop came for it yet
        _received.clear()
    _depth.append(None)
    fired = []

    def handler(signum, frame):
        if fired:
            return
        fired.append(signum)
        _received.append(signal.Signals(signum).name)
        raise Cancelled(signal.Signals(signum).name)

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        _depth.pop()
        for s, h in previous.items():
            signal.signal(s, h)


def one_line(exc: BaseException) -> str:
    """An error as the runs table records it: its type and the first line of its message."""
    if isinstance(exc, Cancelled):
        return str(exc)
    if signalled():
        return f"cancelled by {signalled()}"
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


@contextmanager
def handlers_kept():
    """Within the block a library may set its own SIGTERM or SIGINT handler (Ray's `ray.init` makes
    SIGTERM call `sys.exit`); when the block ends, a handler set in Python before it (a
    `cancel_on_signals` block's) is put back, so a stop signal still cancels the study. A SIGTERM
    that came inside the block, and that the library's handler turned into `SystemExit`, is handed
    to the handler from before the block (which raises `Cancelled`). A default or ignored handler
    before the block is left as the library set it. Outside the main thread (where no handler can
    be set) this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    try:
        yield
    except SystemExit as exc:
        previous = before[signal.SIGTERM]
        if exc.code == signal.SIGTERM and callable(previous) and signal.getsignal(signal.SIGTERM) is not previous:
            previous(signal.SIGTERM, None)  # a cancel_on_signals handler raises Cancelled (once)
        raise
    finally:
        for s, handler in before.items():
            if callable(handler) and signal.getsignal(s) is not handler:
                signal.signal(s, handler)
