"""The worker extension's RPC face: the methods the engine calls with `llm.collective_rpc`, on
every rank. vLLM mixes `PatchgridWorker` into its worker class (LLM(worker_extension_cls=...),
backends.vllm.WORKER_EXTENSION names it), so `self` is vLLM's worker and `self.model_runner` its
V1 model runner. Everything crosses as plain data (msgpack in multiprocess mode).
"""
from __future__ import annotations

from ...model.sites import FAMILIES, get_module
from .hooks import Wrapped
from .kernels import use_cpu_kernels
from .midstack import current_start_layer, start_by
from .session import Session


class PatchgridWorker:
    """Mixed into vLLM's worker class via LLM(worker_extension_cls=...)."""

    def pg_begin(self, sources: dict, keys: list, family: str, shape: dict, start_layer: int = 0, call: int = 0,
                 plans: dict | None = None) -> bool:
        """Start a call: the sources its patches, starts and references read, the site keys it reads
        or writes (their hooks go on now), the layer every request of it starts at, and its plans as
        columns (plan.to_columns), one per vLLM request (request.request_id(call, k) runs plan k)."""
        old = getattr(self, "_pg_session", None)
        if old is not None:
            old.remove()
            self._pg_session = None
        runner = self.model_runner
        if not hasattr(runner, "input_batch"):
            raise RuntimeError(f"patchgrid worker: {type(runner).__name__} is not vLLM's V1 model runner, whose "
                               "batch layout the worker reads; set VLLM_USE_V2_MODEL_RUNNER=0")
        self._pg_session = Session(runner, sources, keys, FAMILIES[family].in_vllm(), shape, start_layer, call, plans)
        return True

    def pg_can_start_midstack(self, family: str) -> bool:
        """Whether a call can start at a later layer: this model's decoder loops over
        layers[start_layer:] (vLLM's pipeline-parallel split) from layer 0, or its layers can be
        swapped for stand-ins (midstack.start_by)."""
        fam = FAMILIES[family].in_vllm()
        model = self.model_runner.get_model()
        try:
            decoder, layers = get_module(model, fam.decoder), get_module(model, fam.layers)
        except (AttributeError, IndexError):
            return False
        return start_by(fam, decoder, layers) is not None

    def pg_end(self, read: bool = True) -> dict | None:
        """End the call: the rows still kept read (`read`: false after a failed generate, whose
        results nobody reads), hooks off, the start layer back; its results (results.CallResults.wire:
        arrays by plan, and the parts of forwards that read more, by tag); None: no call had begun."""
        session = getattr(self, "_pg_session", None)
        if session is None:
            return None
        try:
            if read:
                session.read_pending()
        finally:
            session.remove()
            self._pg_session = None
        return session.results.wire()

    def pg_start_layer(self, family: str) -> int:
        """The layer the model's forwards start at now (0 between calls)."""
        return current_start_layer(FAMILIES[family].in_vllm(), self.model_runner.get_model())

    def pg_use_cpu_kernels(self) -> list[str]:
        """On a CPU, vLLM's C kernels for the RMS norms of this worker's eager forwards
        (kernels.use_cpu_kernels); the ops they now lead, empty elsewhere."""
        return use_cpu_kernels(self.device)

    def pg_model_class(self) -> str:
        """The class vLLM runs the model as (its own model, or TransformersForCausalLM)."""
        return type(self.model_runner.get_model()).__name__

    def pg_hook_count(self) -> int:
        """Forward hooks left on the model, for tests that check nothing leaks between calls (a wrapped
        forward counts, as does the call's idle sampler logits left in place: readout.LogitsReadout)."""
        model = self.model_runner.get_model()
        return ("compute_logits" in model.__dict__) + sum(
            len(m._forward_hooks) + len(m._forward_pre_hooks) + isinstance(m.__dict__.get("forward"), Wrapped)
            for m in model.modules())
