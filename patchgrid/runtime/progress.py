"""Progress of a study's long stages, told to whoever asked for it.

Engines run inside Prefect tasks, whose parameters must be plain values; a console progress bar is
not one. The caller says where progress goes for the duration of a call (`reporting_to`), and each
stage tells `report` its name and how far it is: judging which facts the model knows, capturing
the activation cache, a shard's patched runs, the shards on Ray, loading the warehouse. The
setting is a context variable: it holds for this call and the threads it starts (Prefect's task
runners copy the context into their workers), and never leaks into another caller's run. Nobody
asked (the Python API, a served run): nothing is reported.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import partial

Progress = Callable[[int, int], None]  # one stage's (done, total)
Listener = Callable[[str, int, int, str], None]  # (stage, done, total, note): what a caller is told

_listener: ContextVar[Listener | None] = ContextVar("patchgrid_progress", default=None)


@contextmanager
def reporting_to(listener: Listener) -> Iterator[None]:
    token = _listener.set(listener)
    try:
        yield
    finally:
        _listener.reset(token)


def report(stage: str, done: int, total: int, note: str = "") -> None:
    """`stage` has done `done` of `total` (`note`: what else is worth saying, e.g. pairs accepted so far)."""
    listener = _listener.get()
    if listener is not None:
        listener(stage, done, total, note)


def stage(name: str) -> Progress:
    """`report` for one stage, as a (done, total) callable; picklable, so that it can cross to an
    engine actor (where nobody listens: it reports nothing there)."""
    return partial(report, name)
