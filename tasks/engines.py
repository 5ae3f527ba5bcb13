"""One engine per worker process, reused across tasks; dropped when it fails so a retry rebuilds it."""
from __future__ import annotations

_ENGINES: dict[tuple, object] = {}


def get_engine(model: str, backend: str):
    from patchgrid.engine import load_engine

    key = (model, backend)
    if key not in _ENGINES:
        _ENGINES[key] = load_engine(model, backend)
    return _ENGINES[key]


def drop_engine(model: str, backend: str) -> None:
    engine = _ENGINES.pop((model, backend), None)
    if engine is not None:
        try:
            engine.close()
        except Exception:  # a dead engine may not close cleanly; it is gone either way
            pass


def close_all() -> None:
    for key in list(_ENGINES):
        drop_engine(*key)
