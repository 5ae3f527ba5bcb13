"""One way to get an engine, whatever the backend: `load_engine(model, backend=...)`.

Every backend implements `Engine`: it takes the same `Request`s (patchgrid.plan) and returns
`Result`s in order, or their `Reading`s (patchgrid.metrics).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

from ..model.models import prepare
from ..model.sites import ModelShape, shape_of
from ..plan import Request, Result

if TYPE_CHECKING:  # the command line starts without torch (seconds of its start-up)
    import torch

    from ..metrics import Reading

BACKENDS = ("vllm", "hf")
DEFAULT_BACKEND = "vllm"
DTYPES = ("auto", "float32", "bfloat16", "float16")
_ALL = "*"  # EnginePool: the bound on all engines together
T = TypeVar("T")


class Engine(Protocol):
    shape: ModelShape
    folder: Path  # the model folder it loaded
    dtype: torch.dtype  # the dtype its activations (and so its captures) are in

    def run(self, requests: list[Request], sources: dict | None = None) -> list[Result]: ...

    def readings(self, requests: list[Request], sources: dict | None = None) -> list[Reading]:
        """metrics.Reading.of of each request's Result (a sweep's runs: answers and continuations the
        clean and the corrupt one); an engine may read them without making the Results."""
        ...

    def close(self) -> None: ...


def model_dtype(config) -> str:
    dt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    return str(dt).removeprefix("torch.")


def load_engine(model: str, backend: str = DEFAULT_BACKEND, *, dtype: str = "auto", **options) -> Engine:
    """Prepare `model` (a built-in name, folder or hub id) and start a backend on it."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    from transformers import AutoConfig

    folder = prepare(model)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    shape = shape_of(config)
    if dtype == "auto":
        # vLLM's "auto" downcasts float32 checkpoints to bfloat16 on CPU; both backends must
        # run the dtype the checkpoint says.
        dtype = model_dtype(config)
    if backend == "hf":
        from .hf import HFEngine

        return HFEngine(folder, shape, dtype=dtype, **options)
    from .vllm import VllmEngine

    return VllmEngine(folder, shape, dtype=dtype, **options)


class EnginePool:
    """Engines kept across tasks in one process (each takes seconds to start), by model, backend
    and options. An engine that failed is dropped, so that a retry starts a fresh one.

    `max_live` bounds the engines alive at once (each holds its weights, a vLLM engine a KV cache
    too): a number for all of them, or a number per backend (`{"vllm": 3}`; a backend not named is
    unbounded). Starting one beyond a bound first closes the engine that bound counts which was used
    least recently; it is started again if asked for later."""

    def __init__(self, max_live: int | Mapping[str, int] | None = None):
        limits = {_ALL: max_live} if isinstance(max_live, int) else dict(max_live or {})
        for scope, limit in limits.items():
            if scope != _ALL and scope not in BACKENDS:
                raise ValueError(f"unknown backend {scope!r} in max_live; use one of {', '.join(BACKENDS)}")
            if limit < 1:
                raise ValueError(f"max_live must be at least 1, not {limit}")
        self._limits = limits
        self._engines: dict[tuple, Engine] = {}  # least recently used first

    def get(self, model: str, backend: str = DEFAULT_BACKEND, **options) -> Engine:
        key = (model, backend, tuple(sorted(options.items())))
        if key in self._engines:
            self._engines[key] = self._engines.pop(key)  # now the most recently used
            return self._engines[key]
        self._make_room(backend)
        self._engines[key] = load_engine(model, backend, **options)
        return self._engines[key]

    def live(self) -> list[tuple]:
        """The (model, backend, options) of every live engine, least recently used first."""
        return list(self._engines)

    def _make_room(self, backend: str) -> None:
        """Close the least recently used engines until one more of `backend` keeps within the bounds."""
        for scope in (_ALL, backend):
            limit = self._limits.get(scope)
            if limit is None:
                continue
            counted = [k for k in self._engines if scope == _ALL or k[1] == scope]
            for model, backend_, options in counted[:max(0, len(counted) - limit + 1)]:
                self.drop(model, backend_, **dict(options))

    def run(self, work: Callable[[Engine], T], model: str, backend: str = DEFAULT_BACKEND,
            options: Mapping | None = None) -> T:
        """`work(engine)` on this pool's engine of `model`; an engine whose work raised is dropped, so
        that the next work (a task's retry) starts a fresh one."""
        options = dict(options or {})
        engine = self.get(model, backend, **options)
        try:
            return work(engine)
        except Exception:
            self.drop(model, backend, **options)
            raise

    def drop(self, model: str, backend: str = DEFAULT_BACKEND, **options) -> None:
        engine = self._engines.pop((model, backend, tuple(sorted(options.items()))), None)
        if engine is not None:
            try:
                engine.close()
            except Exception:  # a dead engine may not close cleanly; it is gone either way
                pass

    def close(self) -> None:
        for model, backend, options in list(self._engines):
            self.drop(model, backend, **dict(options))

    def __enter__(self) -> EnginePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Engines:
    """Where a study's model work runs: `run(work)` calls `work(engine)` on an engine of the study's
    model and returns its result. LocalEngines runs it in this process; patchgrid.backends.cluster.RayEngines
    in the next free engine actor of a Ray cluster. `provenance`: a file to record which engine ran
    it in (JSON)."""

    def run(self, work: Callable[[Engine], T], *, provenance: str | None = None) -> T:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LocalEngines(Engines):
    """The study's engine in this process, from `pool` (kept by the caller) or a pool of its own."""

    def __init__(self, model: str, backend: str = DEFAULT_BACKEND, options: Mapping | None = None,
                 pool: EnginePool | None = None):
        self.model, self.backend, self.options = model, backend, dict(options or {})
        self._own = pool is None
        self.pool = pool if pool is not None else EnginePool()

    def run(self, work: Callable[[Engine], T], *, provenance: str | None = None) -> T:
        return self.pool.run(work, self.model, self.backend, self.options)  # this process: nothing to record

    def close(self) -> None:
        if self._own:
            self.pool.close()


def using_engine(fn: Callable[..., T], *args, **kwargs) -> Callable[[Engine], T]:
    """`fn(*args, engine=<the engine>, **kwargs)` as work for `Engines.run`; picklable when `fn` and
    its arguments are, so that it can cross to an engine actor."""
    return partial(_with_engine, fn, args, kwargs)


def _with_engine(fn, args, kwargs, engine):
    return fn(*args, engine=engine, **kwargs)
