"""Progress of the sweeps, told to whoever asked for it.

Engines run inside Prefect tasks, whose parameters must be plain values; a console progress bar is
not one. The caller says where progress goes for the duration of a call (`reporting_to`), and the
sweep tasks tell `report`. The setting is a context variable: it holds for this call and the
threads it starts, and never leaks into another caller's run.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

Progress = Callable[[int, int], None]  # (patched runs done, total) within the current shard

_listener: ContextVar[Progress | None] = ContextVar("patchgrid_progress", default=None)


@contextmanager
def reporting_to(listener: Progress) -> Iterator[None]:
    token = _listener.set(listener)
    try:
        yield
    finally:
        _listener.reset(token)


def report(done: int, total: int) -> None:
    listener = _listener.get()
    if listener is not None:
        listener(done, total)
