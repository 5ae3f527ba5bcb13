"""The reference oracle: plain transformers with forward hooks.

Written for obviousness rather than speed: every hook loops over the batch's rows and applies
each request's plan with plain indexing. Forwards of equal length share a batch (no padding);
`batch_size=1` gives one forward per request, the loop most tutorials use. A request whose answers
are scored whole runs one forward per answer of several tokens (plan.forwards), and every
position from the last prompt token on is unembedded, in float32 from the decoder's last hidden
state (the final norm's output) whatever the model's dtype (backends.unembed). It runs on a GPU when
there is one (`device="auto"`); captures and results come back to the CPU.
"""
from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import torch

from ..metrics import Reading, answer_ranks, kl_divergence, logsumexp_rows
from ..model.sites import QKV, SITES, get_module, parse_key, site_module
from ..plan import (
    LOGPROBS,
    Result,
    call_forwards,
    gaussian_noise,
    join_forwards,
    patch_rows,
    recomputed_heads,
    validate,
)
from .edge_ablation import Layout, check_circuits, cut_by_deltas, delta_bytes
from .hf_circuit import BatchCircuit
from .patterns import knocked_out, patched_head
from .unembed import soft_capped, unembed_float32

ATTENTION = "patchgrid"  # the attention implementation the engine's models run under (sdpa)
# the same with the model's own eager attention: for scores soft-capped before the softmax (Gemma 2),
# which transformers' sdpa silently leaves out
ATTENTION_EAGER = "patchgrid_eager"
HOOK = "_patchgrid_attention"  # the attribute of an attention module holding this forward's hook


def _hooked(module, query, key, value, kwargs):
    hook = getattr(module, HOOK, None)
    if hook is None:
        return query, key, value
    return hook(query, key, value, kwargs.get("scaling"), kwargs.get("sliding_window"), kwargs.get("softcap"))


def _attention(module, query, key, value, *args, **kwargs):
    """transformers' sdpa attention, with the hook the engine set on `module` for this forward
    (None outside its forwards) given q, k and v first: [batch, heads, tokens, head_dim]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    query, key, value = _hooked(module, query, key, value, kwargs)
    return sdpa_attention_forward(module, query, key, value, *args, **kwargs)


def _eager_attention(module, query, key, value, *args, **kwargs):
    """The model's own eager attention (its modeling file's `eager_attention_forward`), hooked alike."""
    query, key, value = _hooked(module, query, key, value, kwargs)
    eager = sys.modules[type(module).__module__].eager_attention_forward
    return eager(module, query, key, value, *args, **kwargs)


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    AttentionInterface.register(ATTENTION_EAGER, _eager_attention)
    AttentionMaskInterface.register(ATTENTION_EAGER, eager_mask)


def attention_implementation(shape) -> str:
    """The attention implementation the hf backend loads a model with: its own method where the family
    bypasses transformers' attention interface (read through `Family.hf_attn_method`), eager
    where the scores are soft-capped, sdpa elsewhere; the last two behind the engine's hook."""
    if shape.family.hf_attn_method:
        return "eager"
    return ATTENTION_EAGER if shape.soft_capped else ATTENTION


def _wrap_attention_method(module, method: str) -> None:
    """Route a family's own attention method (GPT-J: `_attn(query, key, value, mask)`,
    [batch, heads, tokens, head_dim] after the rotary embedding) through the engine's hook."""
    inner = getattr(module, method)

    def attend(query, key, value, *args, **kwargs):
        query, key, value = _hooked(module, query, key, value, {"scaling": 1.0 / float(module.scale_attn)})
        return inner(query, key, value, *args, **kwargs)

    setattr(module, method, attend)


def causal_pattern(query, key, scaling, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Attention weights [batch, heads, query tokens, key tokens] of a causal softmax over scaled
    query-key products, soft-capped (cap * tanh(score / cap)) and limited to the last `window` keys
    where the model does so; grouped key heads are shared by consecutive query heads."""
    key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    scores = (query.float() @ key.float().transpose(-1, -2)) * scaling
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    n = scores.shape[-1]
    ones = torch.ones(n, n, dtype=torch.bool, device=scores.device)
    mask = ones.triu(1)
    if window:
        mask |= ones.tril(-window)
    return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)


class HFEngine:
    name = "hf"

    def __init__(self, model_dir: Path, shape, *, dtype: str = "auto", batch_size: int = 64, device: str = "auto"):
        from transformers import AutoModelForCausalLM

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
        _register_attention()
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype, trust_remote_code=False,
                                                          attn_implementation=attention_implementation(shape))
        if shape.family.hf_attn_method:
            for layer in range(shape.n_layers):
                _wrap_attention_method(site_module(self.model, shape.family, "q", layer), shape.family.hf_attn_method)
        self.model.to(self.device)
        self.model.eval()
        self.shape = shape
        self.folder = Path(model_dir)
        self.batch_size = batch_size
        self.dtype = next(self.model.parameters()).dtype
        cap = shape.family.final_softcap
        self.final_softcap = getattr(self.model.config, cap, None) if cap else None

    def readings(self, requests, sources=None) -> list[Reading]:
        """metrics.Reading.of of each request's Result (Engine.readings)."""
        return [Reading.of(r) for r in self.run(requests, sources)]

    def run(self, requests, sources=None) -> list[Result]:
        sources = sources or {}
        requests = list(requests)
        validate(requests, sources, self.shape)
        check_circuits(requests, sources, self.shape)
        fwds = call_forwards(requests)
        by_len = defaultdict(list)  # forward length -> (request, forward index)
        for i, fs in enumerate(fwds):
            for k, f in enumerate(fs):
                by_len[len(f.tokens)].append((i, k))
        parts: list[list] = [[None] * len(fs) for fs in fwds]
        for items in by_len.values():
            # batch_size forwards at most, and circuit runs' senders' deltas bounded (edge_ablation)
            for chunk in (c for k in range(0, len(items), self.batch_size)
                          for c in cut_by_deltas(items[k:k + self.batch_size],
                                                 lambda ij: delta_bytes(requests[ij[0]], self.shape))):
                batch = [(requests[i], fwds[i][j]) for i, j in chunk]
                for (i, j), part in zip(chunk, self._forward(batch, sources)):
                    parts[i][j] = part
        return [join_forwards(r, fs, ps) for r, fs, ps in zip(requests, fwds, parts)]

    @torch.no_grad()
    def _forward(self, batch, sources) -> list[dict]:
        """One batch of forwards of equal length: each one's part of its request's Result."""
        hooks = _BatchHooks(batch, sources, self.shape, self.device, self.dtype, self._circuit_layout(batch))
        n_prompt = [len(r.tokens) for r, _ in batch]
        length = len(batch[0][1].tokens)
        hooks.install(self.model)
        try:
            ids = torch.tensor([list(f.tokens) for _, f in batch], dtype=torch.long, device=self.device)
            # every position from the earliest last prompt token on
            keep = length - min(n_prompt) + 1
            logits = self._logits(get_module(self.model, self.shape.family.decoder)(input_ids=ids).last_hidden_state,
                                  keep)
        finally:
            hooks.remove()
        out = []
        for b, (r, f) in enumerate(batch):
            n = n_prompt[b]
            rows = logits[b, keep - (length - n + 1):]  # positions n - 1 .. length - 1
            logprobs = torch.log_softmax(rows, dim=-1)
            part = {"captures": hooks.captures[b],
                    "scores": {j: [float(logprobs[k, t]) for k, t in enumerate(r.continuations[j])] for j in f.scores}}
            if f.first:
                part.update(_first_readout(r, rows[0], logprobs[0], sources))
            out.append(part)
        return out

    def _circuit_layout(self, batch):
        """The graph's layout, made on the first batch with a circuit run (None before)."""
        if getattr(self, "_layout", None) is None and any(r.circuit is not None for r, _ in batch):
            from ..methods.graph import EdgeGraph

            self._layout = Layout(EdgeGraph.of(self.shape), self.device)
        return getattr(self, "_layout", None)

    def _logits(self, hidden: torch.Tensor, keep: int) -> torch.Tensor:
        """The float32 logits [batch, keep, vocab] (on the CPU) of the last `keep` positions, from the
        final norm's output `hidden` [batch, tokens, d_model] (the decoder's last hidden state)."""
        head = self.model.get_output_embeddings()
        rows = hidden[:, -keep:]
        logits = unembed_float32(rows.reshape(-1, rows.shape[-1]), head.weight, head.bias, block_rows=None)
        logits = soft_capped(logits[:, : self.shape.vocab_size], self.final_softcap)
        return logits.reshape(rows.shape[0], keep, -1).cpu()

    def close(self):
        self.model = None


def _first_readout(r, lg, logprobs, sources) -> dict:
    """A request's readout at its last prompt position, from its logits `lg` there."""
    part = dict(answer_logits=lg[list(r.answers)].clone(),
                logsumexp=float(logsumexp_rows(lg[None])[0]) if r.reads_vocabulary else None,
                answer_ranks=answer_ranks(lg, list(r.answers)).tolist() if r.answers and r.ranks else [], top_ids=[],
                top_logits=[],
                kl=None if r.reference is None else float(kl_divergence(sources[r.reference][LOGPROBS], logprobs)),
                logprobs=logprobs.clone() if r.logprobs else None)
    if r.top_k:
        vals, ids_ = torch.topk(lg, min(r.top_k, lg.shape[0]))
        part["top_ids"], part["top_logits"] = ids_.tolist(), vals.tolist()
    return part


class _BatchHooks:
    """The hooks of one batch's forward: each request's patches and noise written with plain
    indexing, its captures copied to the CPU."""

    def __init__(self, batch, sources, shape, device, dtype, layout=None):
        self.batch, self.shape, self.dtype = batch, shape, dtype
        self.circuit = (BatchCircuit(batch, sources, shape, layout, device, dtype)
                        if any(r.circuit is not None for r, _ in batch) else None)
        self.captures = [dict() for _ in batch]
        # site key -> [(row, positions, unit, value)]; noise: [(row, positions, value)]
        self.writes, self.noise = defaultdict(list), []
        # layer -> [(row, positions, head, the source's weights of that head [positions, keys])] (pattern
        # patches), and layer -> [(row, query positions, key positions)] (knockouts): heads' outputs the
        # attention hook recomputes (patterns.attend) and writes into z (head.L) through self.writes
        self.patterns, self.knockouts = defaultdict(list), defaultdict(list)
        for b, (r, f) in enumerate(batch):
            n = len(r.tokens)  # patches and noise address the prompt (a whole patch: the forward's every row)
            if r.knockout is not None:
                for layer in r.knockout.layers:
                    self.knockouts[layer].append((b, r.knockout.queries, r.knockout.keys))
            for p in r.patches:
                if p.site == "pattern":
                    pos = patch_rows(p.positions, p.whole, n, len(f.tokens), f.branch)[0]
                    weights = sources[p.source][p.key][pos].view(len(pos), shape.n_heads, n)[:, p.head]
                    self.patterns[p.layer].append((b, pos, p.head, weights.to(device, torch.float32)))
                    continue
                pos, rows = patch_rows(p.positions, p.whole, n, len(f.tokens), f.branch)
                val = sources[p.source][p.key][rows].to(device, dtype)
                if p.unit is not None:
                    uw = shape.unit_width(p.site)
                    val = val[:, p.unit * uw:(p.unit + 1) * uw]
                self.writes[p.key].append((b, pos, p.unit, val))
            for z in r.noise:
                self.noise.append((b, list(z.positions), gaussian_noise(z, shape.d_model).to(device, dtype)))
        self.handles, self.attention_modules = [], []

    def install(self, m) -> None:
        fam = self.shape.family
        keys = set(self.writes) | {k for r, _ in self.batch for k in r.capture}
        keys |= {k for r, _ in self.batch for k in recomputed_heads(r)}
        # the embedding's hook also adds noise, so it is installed whatever the keys
        self.handles.append(get_module(m, fam.embed).register_forward_hook(self.on_embed))
        attention = set()  # the layers whose q, k, v or pattern are read or written
        for key in keys - {"embed"}:
            site, layer = parse_key(key)
            module = site_module(m, fam, site, layer)
            if SITES[site].at == "attention":
                attention.add(layer)
            elif SITES[site].at == "input":
                self.handles.append(module.register_forward_pre_hook(self.on_input(key)))
            else:
                self.handles.append(module.register_forward_hook(self.on_output(key)))
        if self.circuit is not None:
            attention = set(range(self.shape.n_layers))
            self.circuit.install(m, self.handles)
        self.attention_modules = [site_module(m, fam, "q", layer) for layer in attention]
        for layer, module in zip(attention, self.attention_modules):
            setattr(module, HOOK, self.on_attention(layer))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        for module in self.attention_modules:
            setattr(module, HOOK, None)

    def write(self, key, t):  # t: [batch, tokens, width]
        for b, pos, unit, val in self.writes.get(key, ()):
            if unit is None:
                t[b, pos] = val
            else:  # a head's head_dim columns, or a neuron's one
                t.view(t.shape[0], t.shape[1], -1, val.shape[1])[b, pos, unit] = val

    def capture(self, key, t):
        for b, (r, _) in enumerate(self.batch):
            if key in r.capture:
                self.captures[b][key] = t[b].detach().to("cpu", copy=True)

    def on_embed(self, module, args, out):
        self.write("embed", out)
        for b, pos, val in self.noise:
            out[b, pos] = out[b, pos] + val
        self.capture("embed", out)
        return out

    def on_output(self, key):
        def hook(module, args, out):
            t = out[0] if isinstance(out, tuple) else out
            self.write(key, t)
            self.capture(key, t)
        return hook

    def on_input(self, key):
        def hook(module, args):
            self.write(key, args[0])
            self.capture(key, args[0])
        return hook

    def on_attention(self, layer):
        keys = {site: f"{site}.{layer}" for site in QKV}

        def hook(query, key, value, scaling, window, softcap):  # [batch, heads, tokens, head_dim]
            if self.circuit is not None:
                query, key, value = self.circuit.at_attention(layer, query, key, value)
            out = []
            for site, t in zip(QKV, (query, key, value)):
                k = keys[site]
                if k in self.writes:
                    t = t.clone()
                    self.write(k, t.transpose(1, 2))
                self.capture(k, t.transpose(1, 2).flatten(2))
                out.append(t)
            pattern = f"pattern.{layer}"
            if any(pattern in r.capture for r, _ in self.batch):
                w = causal_pattern(out[0], out[1], scaling, window, softcap)  # [batch, heads, q, k]
                self.capture(pattern, w.transpose(1, 2).flatten(2).to(self.dtype))
            self.recompute(layer, *(t.transpose(1, 2) for t in out), scaling, window, softcap)
            return tuple(out)
        return hook

    def recompute(self, layer, query, key, value, scaling, window, softcap):
        """The heads' outputs this layer's pattern patches and knockouts change, from q, k and v
        [batch, tokens, heads, head_dim] as attention reads them, queued as writes into z (head.L)."""
        z = f"head.{layer}"
        for b, pos, head, weights in self.patterns.get(layer, ()):
            out = patched_head(weights, value[b], head, self.shape.n_heads)
            self.writes[z].append((b, pos, head, out.to(self.dtype)))
        for b, queries, keys in self.knockouts.get(layer, ()):
            for q in queries:
                out = knocked_out(query[b, q], key[b], value[b], q, keys, scaling, window, softcap)
                self.writes[z].append((b, [q], None, out.to(self.dtype)))
