"""Engines on a Ray cluster: a study's engine actors, each holding one engine, and a pool that
hands each piece of model work to the next free actor.

Every stage that touches the model (pairing that asks the model, the activation cache, the sweeps
and their attribution gradients) is a function of an engine, `work(engine) -> result`, picklable
(a module-level function or a functools.partial of one). `RayEngines.run(work, ...)` runs it in
whichever actor is free first, so the flow's own process loads no model and needs no GPU.

What can go wrong, and what follows:
- the work raises inside the actor (an engine that failed): the actor drops that engine, so the
  next work it takes starts a fresh one; the error reaches the caller (whose task retries it);
- the actor's process or its node dies: the actor is replaced by a new one, and the work reruns on
  the next free actor (at most `attempts` times);
- a call outlives `timeout_s`: the actor is killed and replaced, and the caller gets a
  TimeoutError naming the setting.
Actors are named by the run, the model, the tensor-parallel size and the code version, and are
all killed when the pool closes, however the run ends.
"""
from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..runtime.stopping import handlers_kept
from .engine import Engines

NAMESPACE = "patchgrid"
# The lines a local Ray that a study starts itself keeps small: no dashboard, a small object store.
LOCAL_RAY = dict(include_dashboard=False, object_store_memory=256 * 1024 * 1024)


def _actor_class():
    import ray

    @ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)
    class EngineActor:
        """One engine of one model, started at the first work and kept across works; an engine whose
        work failed is dropped, and the next work starts a fresh one."""

        def __init__(self, model: str, backend: str, options):
            from .engine import EnginePool

            self.model, self.backend, self.options = model, backend, options
            self.pool = EnginePool(max_live=1)
            self.served = 0
            self.starts = 0
            self.resolved = None

        def ready(self) -> dict:
            return self.where()

        def where(self) -> dict:
            import ray

            return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

        def run(self, work: Callable):
            if self.resolved is None:  # options given as a function are worked out here, on the device, once
                options = self.options() if callable(self.options) else dict(self.options)
                if self.backend == "vllm":
                    # vLLM's engine core in a process of its own: its crash fails one work, not the actor
                    options.setdefault("multiprocess", True)
                self.resolved = options
            options = self.resolved
            if not self.pool.live():
                self.starts += 1
            result = self.pool.run(work, self.model, self.backend, options)
            self.served += 1
            return result, {**self.where(), "served": self.served, "engine_starts": self.starts}

        def close(self) -> None:
            self.pool.close()

    return EngineActor


@dataclass
class _Actor:
    slot: int
    name: str
    handle: object
    ready: object = None  # the ref of its ready() call while it starts


class RayEngines(Engines):
    """`workers` engine actors of one model and backend, for one run.

    `options`: the engines' start options, a dict or a picklable function that gives them, called in
    the actor (where the device is); `gpus`: GPUs per actor (None: `tensor_parallel_size` on a
    cluster with GPUs, 0 on one without); `address`: a Ray cluster (None: a local Ray, started here).
    A plain class, not a dataclass: Prefect rebuilds dataclasses found in a task's parameters."""

    def __init__(self, run_id: str, model: str, model_sha256: str, backend: str, code_version: str, *,
                 workers: int = 2, tensor_parallel_size: int = 1, gpus: float | None = None, options=None,
                 address: str | None = None, timeout_s: float = 3600.0, attempts: int = 3,
                 log: Callable[[str], None] = print):
        self.run_id, self.model, self.model_sha256, self.backend = run_id, model, model_sha256, backend
        self.code_version, self.workers, self.tensor_parallel_size = code_version, workers, tensor_parallel_size
        self.gpus, self.options, self.address = gpus, options if options is not None else {}, address
        self.timeout_s, self.attempts, self.log = timeout_s, attempts, log
        self._free: deque[_Actor] = deque()
        self._starting: list[_Actor] = []
        self._all: dict[int, _Actor] = {}
        self._lock = threading.Condition()
        self._generation = 0
        self._replacements = 0
        self._started_ray = False
        self._closed = False

    # -- life ------------------------------------------------------------------------------------
    def __enter__(self) -> RayEngines:
        import ray

        if not ray.is_initialized():
            kwargs = {} if self.address else dict(LOCAL_RAY)
            with handlers_kept():  # ray.init sets a SIGTERM handler of its own: a study's stays
                ray.init(address=self.address, namespace=NAMESPACE, **kwargs)
            self._started_ray = True
        if self.gpus is None:
            has_gpus = ray.cluster_resources().get("GPU", 0) > 0
            self.gpus = float(self.tensor_parallel_size) if has_gpus else 0.0
        self.log(f"{self.workers} engine actor(s) of {self.model} ({self.backend}, tensor parallel "
                 f"{self.tensor_parallel_size}, {self.gpus:g} GPU each) for run {self.run_id}")
        for slot in range(self.workers):
            self._start(slot)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill every actor of this run, busy or not; disconnect from Ray if this pool connected."""
        import ray

        with self._lock:
            self._closed = True
            actors = list(self._all.values())
            self._all.clear()
            self._free.clear()
            self._starting.clear()
            self._lock.notify_all()
        for actor in actors:
            _kill(actor)
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def where(self) -> list[dict]:
        """Where each actor runs (its name, pid, node and CUDA_VISIBLE_DEVICES), once each has started."""
        import ray

        with self._lock:
            actors = list(self._all.values())
        found = ray.get([a.handle.where.remote() for a in actors], timeout=self.timeout_s)
        return [{"actor": a.name, **w} for a, w in zip(actors, found)]

    def names(self) -> list[str]:
        with self._lock:
            return sorted(a.name for a in self._all.values())

    @property
    def base_name(self) -> str:
        version = re.sub(r"[^A-Za-z0-9_.-]", "_", self.code_version)
        tp = self.tensor_parallel_size
        return f"patchgrid-{self.run_id}-{self.model_sha256[:12]}-{self.backend}-tp{tp}-{version}"

    def _start(self, slot: int) -> None:
        """A new actor in `slot`; it joins the free actors once it answers."""
        self._generation += 1
        name = f"{self.base_name}-{slot}.{self._generation}"
        handle = _actor_class().options(name=name, namespace=NAMESPACE, num_gpus=self.gpus).remote(
            self.model, self.backend, self.options)
        actor = _Actor(slot, name, handle)
        actor.ready = handle.ready.remote()
        with self._lock:
            self._all[slot] = actor
            self._starting.append(actor)
            self._lock.notify_all()

    def _replace(self, actor: _Actor, why: str) -> None:
        _kill(actor)
        with self._lock:
            if self._all.get(actor.slot) is not actor or self._closed:
                return
            del self._all[actor.slot]
            self._replacements += 1
            give_up = self._replacements > self.attempts * self.workers
        self.log(f"engine actor {actor.name} {why}: " + ("not replaced (too many replaced)" if give_up else
                                                         "replaced by a new one"))
        if not give_up:
            self._start(actor.slot)

    # -- work ------------------------------------------------------------------------------------
    def run(self, work: Callable, *, provenance: str | None = None):
        """`work(engine)` in the next free actor; returns its result. See the module's docstring for
        what happens on failures."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        for attempt in range(1, self.attempts + 1):
            actor = self._take()
            try:
                result, where = ray.get(actor.handle.run.remote(work), timeout=self.timeout_s)
            except RayActorError as exc:  # its process or node died: the work reruns elsewhere
                self._replace(actor, f"died ({type(exc).__name__})")
                if attempt == self.attempts:
                    raise RuntimeError(f"every engine actor given this work died ({self.attempts} tries); the "
                                       f"last: {actor.name}") from exc
                continue
            except GetTimeoutError as exc:
                self._replace(actor, f"did not answer within {self.timeout_s:g} s")
                raise TimeoutError(f"engine actor {actor.name} did not finish its work within ray_timeout_s "
                                   f"{self.timeout_s:g} s (--ray-timeout-s): it was killed") from exc
            except BaseException:
                self._give_back(actor)  # the work itself failed; the actor dropped its engine
                raise
            self._give_back(actor)
            if provenance:
                Path(provenance).write_text(json.dumps({"actor": actor.name, "slot": actor.slot, **where}))
            return result
        raise AssertionError("unreachable")

    def _take(self) -> _Actor:
        """The first free actor (actors still starting join when they answer)."""
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            while True:
                if self._closed:
                    raise RuntimeError("the run's engine actors were released")
                self._admit_started()
                if self._free:
                    actor = self._free.popleft()
                    return actor
                if not self._all:
                    raise RuntimeError(f"no engine actor of run {self.run_id} is left: each died or could not start")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no engine actor was free within ray_timeout_s {self.timeout_s:g} s "
                                       f"(--ray-timeout-s); starting: {[a.name for a in self._starting]}")
                self._lock.wait(timeout=0.2)

    def _admit_started(self) -> None:
        """Under the lock: actors whose start finished become free; one whose start failed is replaced."""
        import ray

        if not self._starting:
            return
        done, _ = ray.wait([a.ready for a in self._starting], num_returns=len(self._starting), timeout=0)
        for actor in [a for a in self._starting if a.ready in done]:
            self._starting.remove(actor)
            try:
                ray.get(actor.ready, timeout=0)
            except Exception as exc:  # it could not start: try another, outside the lock
                threading.Thread(target=self._replace, args=(actor, f"could not start ({exc})"),
                                 daemon=True).start()
                continue
            actor.ready = None
            self._free.append(actor)

    def _give_back(self, actor: _Actor) -> None:
        with self._lock:
            if self._all.get(actor.slot) is actor and not self._closed:
                self._free.append(actor)
            self._lock.notify_all()


def _kill(actor: _Actor) -> None:
    import ray

    try:
        ray.kill(actor.handle, no_restart=True)
    except Exception:  # already gone, or Ray is shutting down
        pass
