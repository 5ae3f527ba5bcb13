"""One engine call inside the worker: its sources, the sites' widths on this rank, the vLLM requests
seen so far, the hooks it installed and the results gathered; between `pg_begin` and `pg_end`.

At every step the embedding's pre-hook plans the step (step.plan_step); the site hooks
(hooks.SiteHooks), the start layer (midstack.MidstackStart) and the logits readout
(readout.LogitsReadout) then read that step's plan. Plans and values are put together on the CPU
and moved to the activations' device once per step; captures go to the CPU.
"""
from __future__ import annotations

from ...metrics import KlReference
from ...plan import LOGPROBS, decode_tensor, to_columns
from ...sites import SITES, Family, get_module
from ...tp import units_per_rank
from .circuit import CircuitHooks
from .columns import Columns
from .hooks import SiteHooks
from .midstack import MidstackStart
from .readout import LogitsReadout
from .request import Sources, plan_index
from .results import CallResults
from .step import Step, plan_step


def site_widths(shape: dict, tp_size: int) -> dict:
    """This rank's width of each site: z is split over tensor-parallel ranks by heads, the MLP's
    hidden layer by neurons; and the whole model's units and their widths."""
    n_kv = shape.get("n_kv_heads") or shape["n_heads"]
    z = units_per_rank(shape["n_heads"], tp_size) * shape["head_dim"]
    kv = units_per_rank(n_kv, tp_size, "key/value heads") * shape["head_dim"] if n_kv % tp_size == 0 else 0
    local = {"z": z, "q": z, "kv": kv, "mlp": units_per_rank(shape["d_mlp"], tp_size, "MLP neurons"),
             "d_model": shape["d_model"], "pattern": 0}
    widths = {name: local[site.width] for name, site in SITES.items()}
    widths.update(d_model=shape["d_model"],
                  units={"head": shape["n_heads"], "kv_head": n_kv, "neuron": shape["d_mlp"]},
                  unit_width={"head": shape["head_dim"], "kv_head": shape["head_dim"], "neuron": 1})
    return widths


def tp_rank_and_size() -> tuple[int, int]:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except Exception:  # no parallel state: a single rank
        return 0, 1


class Session(SiteHooks, MidstackStart, LogitsReadout, CircuitHooks):
    def __init__(self, runner, sources, keys, family: Family, shape: dict, start_layer: int = 0, call: int = 0,
                 plans: dict | None = None):
        self.runner = runner
        self.call = call  # its plans (plan.to_columns) are by vLLM request: request_id(call, k) runs plan k
        self.model = runner.get_model()
        self.family = family
        self.vocab = shape["vocab_size"]
        param = next(self.model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.sources = Sources(sources, self.dtype)
        # reference distributions, prepared once for the KL divergence of every row read from them
        # (float64, on the activations' device: read every step)
        self.references = {name: KlReference(decode_tensor(caps[LOGPROBS]).to(self.device))
                           for name, caps in sources.items() if LOGPROBS in caps}
        self.tp = tp_rank_and_size()
        self.widths = site_widths(shape, self.tp[1])
        # the call's plans, as columns (plan.to_columns) completed with what only the worker knows
        self.plans = Columns(plans if plans is not None else to_columns([], []), self.sources, self.references,
                             self.widths, self.dtype, self.tp)
        # what the readout reads, by plan; pg_end returns it
        self.results = CallResults(self.plans.answer_ids)
        self.results.hand_out(self.plans.score_start, len(self.plans.score_token))
        # the plan each vLLM request seen so far runs, by id (-1: a request of no patchgrid call)
        self.requests: dict[str, int] = {}
        self.step = Step()
        self.handles = []
        self.pattern_keys = {}  # a pattern capture's buffer (id) -> its request's keys so far, per layer
        self.start_layer = start_layer
        # Gemma's decoder multiplies the embedding module's output by sqrt(d_model) (its `normalizer`)
        # after the module: the embed site is the product, as transformers' module returns it
        self.embed_scale = get_module(self.model, family.decoder).normalizer if family.embed_scaled else None
        self.circuit_layout = None
        self._model_logits = self._own_logits = None  # the model's compute_logits while the sampler idles
        try:
            if any(r.circuit is not None for r in self.plans.special.values()):
                self._install_circuit(shape["n_heads"], shape["n_kv_heads"])
            self._install(set(keys))
            self._idle_sampler()
            if start_layer:
                self._start_at(start_layer)
        except BaseException:
            self.remove()
            raise

    def remove(self):
        self._restore_start()
        self._restore_sampler()
        for h in self.handles:
            h.remove()
        self.handles = []

    def _begin_step(self, module, args):
        self.step = Step()
        self.step = plan_step(self.runner, self._plan_of, self.plans, self.sources, self.start_layer, self.widths,
                              self.device)
        if self.step.circuit_rows:
            self._circuit_begin_step()

    def _plan_of(self, rid: str) -> int:
        k = self.requests.get(rid)
        return self._new_request(rid) if k is None else k

    def _new_request(self, rid) -> int:
        k = plan_index(rid, self.call)
        k = -1 if k is None else k
        if k >= 0 and (want := int(self.plans.n_tokens[k])) != (n := len(self.runner.requests[rid].prompt_token_ids)):
            raise RuntimeError(f"patchgrid worker: request {rid} has {n} tokens, its plan {want}")
        if self.start_layer and (k < 0 or self.plans.start_layer[k] != self.start_layer):
            # every row of a call that starts mid-stack needs its stream; the engine groups calls so
            raise RuntimeError(f"patchgrid worker: request {rid} does not start at layer {self.start_layer}, "
                               "as every request of this call must")
        self.requests[rid] = k
        return k
