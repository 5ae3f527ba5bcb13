"""Attribution patching (AtP): every site's effect estimated from one clean forward and one corrupt
forward and backward, on plain transformers (vLLM has no backward pass).

For a site a (a layer's stream, attention or MLP output, a head's slice of z, one MLP neuron, a
head's v) at position t, patching the clean activation into the corrupt run changes the pair's
metric M by about

    c(a, t) = (a_clean[t] - a_corrupt[t]) . dM/da[t]      (the gradient taken at the corrupt run)

and patching it at every position at once by the sum over t. M is the log-probability difference
of the clean and the corrupt answer, each summed over its tokens (scored teacher-forced, as the
engine scores them); for one-token answers it equals the logit difference. The gradient of a pair
whose answers take several forwards (plan.forwards) is the sum of each forward's, over the prompt's
positions, which every forward shares.

q, k and v are the tensors attention reads (after the rotary embedding and q/k norms: what the
engine patches), handed over by a tap on each layer's attention (patchgrid.methods.qkfix's attention
implementations: transformers' sdpa, or the model's eager attention where scores are soft-capped,
GPT-J's `_attn`), which computes attention as the model does. Queries and keys are estimated with
AtP*'s QK fix (Kramár et al. 2024, arXiv 2403.00745, section 3.1.1; patchgrid.methods.qkfix): the head's
attention pattern recomputed exactly with the clean query (key), linear only from the pattern on,
dM/dA read from the gradient at z; their plain AtP (linear through the softmax) is returned beside
it (`plain`), and `qk_fix=False` takes it as the estimate. v lies after the softmax: linear, as AtP.

GradDrop (AtP*, section 3.1.2, eq. 11) guards against cancellation between a site's direct and
indirect effects: for each layer l, AtP+GD_l is the estimate with the gradient through layer l's
residual-stream contribution (the outputs of its attention and MLP, the post-norms' where the
family has them) set to zero on the backward pass, and the site's score is (1/(L-1)) sum_l
|AtP+GD_l|: for a node inside layer l its own term is zero, so that is the mean over the other
layers. A site read at a cut output (attn_out, mlp_out) lies before its layer's cut. A resid site
(a layer's output, which the paper does not consider) lies after its layer's cut: its term l, and
those of the layers before it, are its plain |estimate|, and it is divided by L - 1 all the same.
It is unsigned and only ranks sites; the plain signed estimate is always computed beside it.
Paths from the other sites through later heads' softmaxes stay linearised, in AtP* and here.

Pairs of one prompt length share a batch; gradients are taken only for the site kinds asked for.
It runs on a GPU when there is one, or where asked (a study's atp_device, in atp_dtype); estimates
come back to the CPU.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from ..model.sites import QKV, SITES, ModelShape, get_module, parse_key, site_key, site_module
from ..plan import Request, forwards
from .qkfix import ATTENTION, ATTENTION_EAGER, TAP, Scores, qk_estimates, register_attention, tap_attention_method

ATP_SITES = ("resid", "attn_out", "mlp_out", "head", "neuron", "q", "k", "v")
BATCH_PAIRS = 16  # pairs of one prompt length per gradient batch (the memory plan sizes its activations by it)
CORRECTIONS = ("none", "graddrop")
QK_FIXED = ("q", "k")  # the sites AtP*'s QK fix estimates (patchgrid.methods.qkfix)
class _Gate(torch.autograd.Function):
    """The identity, whose backward passes no gradient while its layer is the one dropped (GradDrop)."""

    @staticmethod
    def forward(ctx, x, layer, state):
        ctx.layer, ctx.state = layer, state
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (torch.zeros_like(grad) if ctx.state.get("drop") == ctx.layer else grad), None, None


@dataclass(frozen=True)
class _Batch:
    """One batch of pairs of one prompt length, between its forwards and its estimates."""

    groups: list  # per length of the corrupt forwards: (pair rows, activations, objective)
    delta: dict  # per site key: clean - corrupt over the prompt, [pairs, n, width]
    clean: dict  # per site key: the clean run's activation, [pairs, n, width]
    n: int  # the prompt's length
    sites: tuple  # the site kinds asked for
    fixed: tuple  # those estimated with the QK fix


def _name(site: str, fixed: tuple) -> str:
    """Where `_estimates` puts a site's estimate: its QK-fixed one for a site in `fixed`."""
    return f"{site}:qk" if site in fixed else site


class Attributor:
    """AtP estimates on a transformers causal LM (float32 by default: the estimates are a
    linearisation, and half precision adds its own error to them)."""

    def __init__(self, model, shape: ModelShape, batch_size: int = BATCH_PAIRS):
        self.model = model
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)  # gradients are taken for activations only
        self.shape = shape
        self.batch_size = batch_size
        self.device = next(model.parameters()).device
        self._gate_state = {"drop": None}  # which layer's backward GradDrop cuts now
        self._scores: dict[int, Scores] = {}  # per layer, how its attention scores q against k
        self._taps: dict[int, dict] = {}  # per layer, the q, k, v recorders of this forward
        self._install_taps()
        # estimates are accumulated in float32 at least (float64 for a float64 model)
        self.acc = torch.promote_types(next(model.parameters()).dtype, torch.float32)

    @classmethod
    def load(cls, model_dir: Path, shape: ModelShape, *, dtype: str = "float32", device: str | None = None,
             batch_size: int = BATCH_PAIRS) -> Attributor:
        """The gradient model of `model_dir` in `dtype` on `device` (None or "auto": a GPU when there is one)."""
        from transformers import AutoModelForCausalLM

        device = gradient_device(device)
        # transformers' default sdpa would drop a soft cap on the attention scores (Gemma 2); the
        # Attributor then runs either behind its tap (_install_taps)
        extra = {"attn_implementation": "eager"} if shape.soft_capped else {}
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), **extra)
        return cls(model.to(device), shape, batch_size)

    def estimate(self, pairs, sites=ATP_SITES, correction: str = "none",
                 qk_fix: bool = True) -> list[dict[str, dict[str, torch.Tensor]]]:
        """Per pair, per site kind: `estimate` [n_layers, positions + 1, units] (float32, or float64 for
        a float64 model), the last position index being every position at once (units: 1, heads,
        key/value heads or neurons); with `correction="graddrop"` also `graddrop`, the same shape.
        q and k are estimated with AtP*'s QK fix unless `qk_fix` is False; with it, their plain
        (linearised) AtP estimate is there too, as `plain`."""
        bad = [s for s in sites if s not in ATP_SITES]
        if bad:
            raise ValueError(f"attribution patching estimates {', '.join(ATP_SITES)}; not {bad[0]!r}")
        if correction not in CORRECTIONS:
            raise ValueError(f"unknown correction {correction!r}; use one of {', '.join(CORRECTIONS)}")
        if correction == "graddrop" and self.shape.n_layers < 2:
            raise ValueError("GradDrop averages over the layers other than a node's own: it needs two layers or more")
        by_len = defaultdict(list)
        for i, p in enumerate(pairs):
            by_len[len(p.corrupt_ids)].append(i)
        out: list = [None] * len(pairs)
        for idx in by_len.values():
            for k in range(0, len(idx), self.batch_size):
                chunk = idx[k:k + self.batch_size]
                got = self._batch([pairs[i] for i in chunk], tuple(sites), correction, qk_fix)
                for i, one in zip(chunk, got):
                    out[i] = one
        return out

    def close(self):
        self.model = None

    # ---- one batch of pairs of one prompt length ----
    def _batch(self, pairs, sites, correction, qk_fix):
        n, L = len(pairs[0].corrupt_ids), self.shape.n_layers
        fixed = tuple(s for s in sites if s in QK_FIXED) if qk_fix else ()
        # the QK fix reads the layer's q, k, v and the gradient at its z (head) beside the sites asked for
        needed = tuple(dict.fromkeys(sites + (("q", "k", "v", "head") if fixed else ())))
        keys = [site_key(s, layer) for s in needed for layer in range(L)]
        clean = self.clean_activations(pairs, keys)
        reqs = [Request(tokens=p.corrupt_ids, continuations=p.continuations) for p in pairs]
        by_len = defaultdict(list)  # the corrupt run's forwards, by length
        for b, r in enumerate(reqs):
            for f in forwards(r):
                by_len[len(f.tokens)].append((b, f))
        drops = list(range(L)) if correction == "graddrop" else []
        groups, delta = [], {}
        for items in by_len.values():
            acts, objective = self.corrupt_forward(reqs, items, keys, bool(drops))
            rows = torch.tensor([b for b, _ in items], device=self.device)
            groups.append((rows, acts, objective))
            for key in keys:  # every forward of a pair holds its prompt, and computes the same there
                diff = clean[key][rows] - acts[key][:, :n].detach().to(self.acc)
                delta.setdefault(key, torch.zeros_like(clean[key]))[rows] = diff
        batch = _Batch(groups, delta, clean, n, sites, fixed)
        est = self._estimates(batch, None)
        out = [{s: {"estimate": est[_name(s, fixed)][b].cpu()} for s in sites} for b in range(len(pairs))]
        for s in fixed:
            for b in range(len(pairs)):
                out[b][s]["plain"] = est[s][b].cpu()
        if drops:
            # AtP*'s GradDrop: (1 / (L - 1)) sum over l of |AtP + GD_l|
            score = {s: torch.zeros_like(est[s]) for s in sites}
            for d in drops:
                cut = self._estimates(batch, d)
                for s in sites:
                    score[s] += cut[_name(s, fixed)].abs()
            for b in range(len(pairs)):
                for s in sites:
                    out[b][s]["graddrop"] = (score[s][b] / (L - 1)).cpu()
        return out

    def _estimates(self, batch: _Batch, drop) -> dict[str, torch.Tensor]:
        """Per site kind, [pairs, L, n + 1, units]: the estimates from the gradient taken with
        layer `drop`'s output cut on the backward pass (None: the plain gradient), summed over the
        forwards; the QK-fixed estimates of q and k under `_name(site, fixed)` beside the plain ones."""
        self._gate_state["drop"] = drop
        out: dict[str, torch.Tensor] = {}
        for rows, acts, objective in batch.groups:
            keys = list(acts)
            grads = dict(zip(keys, torch.autograd.grad(objective, [acts[k] for k in keys], retain_graph=True,
                                                       allow_unused=True)))
            for key in keys:
                site, layer = parse_key(key)
                g = grads[key]
                pairs = len(batch.delta[key])
                if site in batch.sites:  # a pair may have two forwards in a group: index_add sums them
                    value = (self._contract(site, batch.delta[key][rows], g[:, :batch.n]) if g is not None
                             else torch.zeros(len(rows), batch.n + 1, self.shape.units(site) or 1, device=self.device))
                    self._add(out, site, layer, rows, value, pairs)
                if site in batch.fixed:
                    self._add(out, _name(site, batch.fixed), layer, rows,
                              self._fixed(batch, acts, grads, site, layer, rows), pairs)
        self._gate_state["drop"] = None
        return out

    def _add(self, out, name, layer, rows, value, n_pairs):
        """Add `value` [rows, n + 1, units] into `out[name]` [n_pairs, L, n + 1, units] at `layer`, pairs `rows`."""
        if name not in out:
            out[name] = torch.zeros(n_pairs, self.shape.n_layers, *value.shape[1:], device=self.device, dtype=self.acc)
        out[name][:, layer].index_add_(0, rows, value.to(self.acc))

    def _fixed(self, batch, acts, grads, site, layer, rows) -> torch.Tensor:
        """The QK-fixed estimate of `site` (q or k) at `layer` for one group of forwards."""
        grad_z = grads[site_key("head", layer)]
        if grad_z is None:  # the gradient does not reach this layer's attention (GradDrop's cut)
            grad_z = torch.zeros_like(acts[site_key("head", layer)])
        corrupt = {s: acts[site_key(s, layer)].detach() for s in QKV}
        return qk_estimates(site, corrupt, batch.clean[site_key(site, layer)][rows], grad_z.detach(),
                            self._scores[layer], self.shape.head_dim)

    def _contract(self, site: str, delta: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """[B, n, width] x [B, n, width] -> [B, n + 1, units]: each unit's estimate per position,
        then at every position at once (the sum: the estimate is linear in the patch)."""
        prod = delta.to(self.acc) * grad.to(self.acc)
        B, n, _ = prod.shape
        if SITES[site].unit is None:
            per = prod.sum(-1, keepdim=True)
        else:
            per = prod.view(B, n, self.shape.units(site), self.shape.unit_width(site)).sum(-1)
        return torch.cat([per, per.sum(1, keepdim=True)], dim=1)

    @torch.no_grad()
    def clean_activations(self, pairs, keys) -> dict[str, torch.Tensor]:
        """The clean prompts' activations at every site key, [pairs, n, width]."""
        acts = {}

        def record(key, t):
            acts[key] = t.detach().to(self.acc)

        handles = [self.hook(key, record) for key in keys]
        try:
            ids = torch.tensor([list(p.clean_ids) for p in pairs], device=self.device)
            self.model(input_ids=ids, logits_to_keep=1)
        finally:
            for h in handles:
                h.remove()
        return acts

    def corrupt_forward(self, reqs, items, keys, gated: bool):
        """One batch of the corrupt run's forwards of equal length, with its activations at `keys`
        in the graph: (activations, the summed metric to differentiate)."""
        acts = {}
        handles = [self.hook(key, acts.__setitem__) for key in keys]
        # the weights take no gradient: the graph starts at the token embeddings
        handles.append(get_module(self.model, self.shape.family.embed).register_forward_hook(
            lambda mod, args, out: out.requires_grad_(True)))
        if gated:
            handles += self._gates(self._gate_state)
        try:
            ids = torch.tensor([list(f.tokens) for _, f in items], device=self.device)
            # the batch's prompts are of one length: the logits from its last position on are read
            length, n = ids.shape[1], len(reqs[items[0][0]].tokens)
            keep = length - n + 1
            with torch.enable_grad():
                logits = self.model(input_ids=ids, logits_to_keep=keep).logits[..., : self.shape.vocab_size]
                logprobs = torch.log_softmax(logits.to(self.acc), dim=-1)
                objective = logprobs.new_zeros(())
                for j, (b, f) in enumerate(items):
                    for c in f.scores:  # continuation 0 is the clean answer, 1 the corrupt one
                        tokens = reqs[b].continuations[c]
                        sign = 1.0 if c == 0 else -1.0
                        pos = torch.arange(len(tokens), device=self.device)  # from position n - 1 on
                        objective = objective + sign * logprobs[j, pos, torch.tensor(tokens, device=self.device)].sum()
        finally:
            for h in handles:
                h.remove()
        missing = [k for k in keys if k not in acts]
        if missing:
            raise RuntimeError(f"attribution: no activation was read at {missing[0]}")
        return acts, objective

    def hook(self, key: str, record):
        """A hook handing `record(key, tensor)` the site's activation [batch, tokens, width]."""
        site, layer = parse_key(key)
        if SITES[site].at == "attention":  # q, k, v: through the tap on the layer's attention
            return _Untap(self._taps.setdefault(layer, {}), site, record)
        module = site_module(self.model, self.shape.family, site, layer)
        if SITES[site].at == "input":
            return module.register_forward_pre_hook(lambda mod, args: record(key, args[0]))

        def on_output(mod, args, out):
            record(key, out[0] if isinstance(out, tuple) else out)

        return module.register_forward_hook(on_output)

    def _install_taps(self) -> None:
        """The attention implementation that hands each layer's q, k and v to `_tap` (after the rotary
        embedding, as the engine patches them), computing attention as the model does otherwise."""
        fam = self.shape.family
        register_attention()
        if fam.hf_attn_method:
            for layer in range(self.shape.n_layers):
                tap_attention_method(site_module(self.model, fam, "q", layer), fam.hf_attn_method)
        else:  # sdpa, or eager where the scores are soft-capped (transformers' sdpa drops the cap)
            self.model.set_attn_implementation(ATTENTION_EAGER if self.shape.soft_capped else ATTENTION)
        for layer in range(self.shape.n_layers):
            setattr(site_module(self.model, fam, "q", layer), TAP, self._tap(layer))

    def _tap(self, layer: int):
        def tap(query, key, value, scores):  # [batch, heads, tokens, head_dim]
            self._scores[layer] = scores
            records = self._taps.get(layer)
            if not records:
                return query, key, value
            out = []
            for site, t in zip(QKV, (query, key, value)):
                flat = t.transpose(1, 2).flatten(2)  # [batch, tokens, heads * head_dim], in the graph
                if site in records:
                    records[site](site_key(site, layer), flat)
                out.append(flat.unflatten(2, (t.shape[1], t.shape[3])).transpose(1, 2))
            return tuple(out)
        return tap

    def _gates(self, state) -> list:
        """GradDrop's gates: on each layer's residual-stream contribution, the outputs of its attention
        and its MLP (the post-norms' where the family has them), after the sites' own hooks, so a
        site at that output lies before its layer's cut."""
        fam = self.shape.family
        handles = []
        for layer in range(self.shape.n_layers):
            for where in ("attn_out", "mlp_out"):
                def gate(mod, args, out, layer=layer):
                    if isinstance(out, tuple):
                        return (_Gate.apply(out[0], layer, state),) + tuple(out[1:])
                    return _Gate.apply(out, layer, state)
                handles.append(site_module(self.model, fam, where, layer).register_forward_hook(gate))
        return handles


class _Untap:
    """The handle of a recorder on a layer's attention tap."""

    def __init__(self, records: dict, site: str, record):
        self.records, self.site = records, site
        records[site] = record

    def remove(self) -> None:
        self.records.pop(self.site, None)


def gradient_device(device: str | None) -> str:
    """Where the gradient model runs: `device`, or (None, "auto") a GPU when there is one, else the CPU."""
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def attributor_for(engine, *, device: str | None = None, dtype: str = "float32") -> Attributor:
    """An Attributor on `engine`'s model, in `dtype` on `device` (None: a GPU when there is one), made
    once per engine and options."""
    made = getattr(engine, "_attributors", None)
    if made is None:
        made = engine._attributors = {}
    key = (gradient_device(device), dtype)
    if key not in made:
        made[key] = Attributor.load(engine.folder, engine.shape, device=key[0], dtype=dtype)
    return made[key]
