"""One engine call inside the worker: its sources, the sites' widths on this rank, the vLLM requests
seen so far, the hooks it installed and the results gathered; between `pg_begin` and `pg_end`.

At every step the embedding's pre-hook plans the step (step.plan_step); the site hooks
(hooks.SiteHooks), the start layer (midstack.MidstackStart) and the logits readout
(readout.LogitsReadout) then read that step's plan. Plans and values are put together on the CPU
and moved to the activations' device once per step; captures go to the CPU.
"""
from __future__ import annotations

import numpy as np

from ...metrics import KlReference
from ...model.sites import SITES, Family, get_module
from ...model.tp import units_per_rank
from ...plan import LOGPROBS, decode_tensor, to_columns
from ..unembed import Scratch
from .circuit import CircuitHooks
from .columns import Columns
from .held import Sources, plan_indices
from .hooks import SiteHooks
from .midstack import MidstackStart
from .readout import LogitsReadout, PendingReads
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
        self.scratch = Scratch()  # the read rows' logits, one buffer reused from step to step of the call
        self.pending = PendingReads()  # read rows kept until they fill whole blocks of the unembedding's product
        self.read_logits = None  # the float32 logits of the rows read last (rank 0)
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
        self.step = plan_step(self.runner, self._plans_of, self.plans, self.sources, self.start_layer, self.widths,
                              self.device)
        if self.step.circuit_rows:
            self._circuit_begin_step()

    def _plans_of(self, rids: list) -> np.ndarray:
        """The plan each of a step's vLLM requests runs (-1: a request of no patchgrid call); those seen
        for the first time checked: a plan's length is its request's, and in a call that starts
        mid-stack every request starts there."""
        seen = self.requests
        ks = [seen.get(rid, -2) for rid in rids]
        if -2 in ks:
            new = [i for i, k in enumerate(ks) if k == -2]
            fresh = [rids[i] for i in new]
            got = plan_indices(fresh, self.call)
            self._check_new(fresh, np.array(got, dtype=np.int64))
            for i, rid, k in zip(new, fresh, got):
                seen[rid] = ks[i] = k
        return np.array(ks, dtype=np.int64)

    def _check_new(self, rids: list, ks: np.ndarray) -> None:
        ours = ks >= 0
        if ours.any():
            mine = [rid for rid, o in zip(rids, ours) if o]
            want = self.plans.n_tokens[ks[ours]]
            have = np.array([len(self.runner.requests[rid].prompt_token_ids) for rid in mine])
            if (want != have).any():
                i = int(np.flatnonzero(want != have)[0])
                raise RuntimeError(f"patchgrid worker: request {mine[i]} has {have[i]} tokens, its plan {want[i]}")
        if self.start_layer:
            # every row of a call that starts mid-stack needs its stream; the engine groups calls so
            wrong = ~ours | (self.plans.start_layer[np.where(ours, ks, 0)] != self.start_layer)
            if wrong.any():
                raise RuntimeError(f"patchgrid worker: request {rids[int(np.flatnonzero(wrong)[0])]} does not start at "
                                   f"layer {self.start_layer}, as every request of this call must")
