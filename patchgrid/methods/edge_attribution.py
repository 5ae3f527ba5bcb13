"""Edge attribution patching on the graph of patchgrid.methods.graph: every edge of a pair scored from
gradients on plain transformers (vLLM has no backward pass), by EAP or EAP-IG.

EAP (Syed et al. 2023, arXiv 2310.10348) scores an edge u -> v as

    s(u -> v) = sum over the prompt's positions t of (u_clean[t] - u_corrupt[t]) . dM/dv_in[t]

u's clean-minus-corrupt output dotted with the gradient of the metric M at v's input, the gradient
taken at the corrupt run: the first-order estimate of M's change when the edge alone carries the
clean value into the corrupt run (denoising, as patchgrid's attribution patching; the EAP-IG code's
EAP takes the gradient at the clean run with corrupt-minus-clean outputs, the noising form). A
receiver's input gradient is its own: dM/dq_h (the gradient at head h's query as attention reads
it) carried back through the query's projection (and norm, rotary embedding) alone to the stream the
layer reads, and likewise for k, v (by key/value head), the MLP (dM at its output back to the stream
it reads) and the logits (dM at the final stream). Summed over a receiver's senders, the scores
give the attribution-patching estimate of patching that receiver's input stream.

EAP-IG (Hanna et al. 2024, "Have Faith in Faithfulness"; the EAP-IG code's `EAP-IG-inputs`) averages
the gradient over `steps` runs whose input (the stream the first layer reads) lies on the line from
the corrupt input to the clean one, input_k = corrupt + (k / steps) (clean - corrupt) for
k = 0 .. steps - 1, as the EAP-IG code does: its first point is the corrupt run, so with one step
EAP-IG is EAP. The default of 30 steps is the EAP-IG code's (`get_scores_eap_ig`).

M is the log-probability difference of the clean and corrupt answers, each summed over its tokens
(patchgrid.methods.attribution's objective; for one-token answers the logit difference). Edges are position-
agnostic by default (summed over the prompt's positions, as MIB's); `per_position` keeps each
position's term. Answers of several tokens: every forward of a pair adds its gradient over the
prompt's positions, which every forward shares.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from ..model.sites import site_key, site_module
from ..plan import Request, forwards
from .graph import EdgeGraph

METHODS = ("eap", "eap-ig")
IG_STEPS = 30  # the EAP-IG code's default (get_scores_eap_ig)
# A batch's senders' outputs and receivers' gradients ([pairs, tokens, senders + receivers, d_model],
# float32) are held at once: pairs per batch are cut so that they stay under this (an 8B model's take
# about 0.4 GiB per pair of 20 tokens).
EDGE_TENSOR_BYTES = 2 << 30


def edge_tensor_bytes(graph: EdgeGraph, d_model: int, pairs: int, tokens: int, per_position: bool = False) -> int:
    """What a batch of `pairs` prompts of `tokens` holds besides the gradient pass: the senders' outputs
    and the receivers' gradients (float32), and the scores."""
    senders, receivers = len(graph.senders), len(graph.receivers)
    scores = senders * receivers * pairs * (tokens if per_position else 1)
    return 4 * ((senders + receivers) * d_model * pairs * tokens + scores)


def edge_batch_pairs(graph: EdgeGraph, d_model: int, tokens: int, most: int, per_position: bool = False) -> int:
    """Pairs per batch: at most `most`, and as many as keep edge_tensor_bytes under EDGE_TENSOR_BYTES."""
    one = edge_tensor_bytes(graph, d_model, 1, tokens, per_position)
    return max(1, min(most, EDGE_TENSOR_BYTES // one))


class EdgeScorer:
    """EAP and EAP-IG edge scores on an Attributor's model (patchgrid.methods.attribution: its taps on q, k
    and v, its clean and corrupt forwards)."""

    def __init__(self, attributor):
        self.at = attributor
        self.shape = attributor.shape
        self.graph = EdgeGraph.of(attributor.shape)
        self.mask = self.graph.mask().to(attributor.device)

    def scores(self, pairs, method: str = "eap", steps: int = IG_STEPS, per_position: bool = False) -> list:
        """Per pair, its edges' scores: [senders, receivers] (float32, or float64 for a float64 model;
        zero where no edge is, graph.mask), or with `per_position` [prompt positions, senders,
        receivers]."""
        if method not in METHODS:
            raise ValueError(f"unknown edge method {method!r}; use one of {', '.join(METHODS)}")
        if method == "eap":
            steps = 1
        elif steps < 1:
            raise ValueError(f"ig_steps {steps}: EAP-IG needs at least one step")
        by_len = defaultdict(list)
        for i, p in enumerate(pairs):
            by_len[len(p.corrupt_ids)].append(i)
        out: list = [None] * len(pairs)
        for n, idx in by_len.items():
            size = edge_batch_pairs(self.graph, self.shape.d_model, n + longest_answer(pairs, idx),
                                    self.at.batch_size, per_position)
            for k in range(0, len(idx), size):
                chunk = idx[k:k + size]
                got = self._batch([pairs[i] for i in chunk], steps, per_position)
                for i, one in zip(chunk, got):
                    out[i] = one.cpu()
        return out

    # ---- one batch of pairs of one prompt length ----
    def _keys(self) -> tuple[list[str], list[str]]:
        """(what the senders' outputs are read from, what the receivers' gradients are read at)."""
        L = self.shape.n_layers
        senders = ["resid_pre.0"] + [site_key(s, layer) for layer in range(L) for s in ("head", "mlp_out")]
        mlp_in = "resid_pre" if self.graph.parallel else "resid_mid"
        receivers = [site_key(s, layer) for layer in range(L) for s in ("resid_pre", "q", "k", "v", "mlp_out", mlp_in)]
        return senders, list(dict.fromkeys(receivers + [site_key("resid", L - 1)]))

    def _batch(self, pairs, steps: int, per_position: bool) -> list[torch.Tensor]:
        n = len(pairs[0].corrupt_ids)
        sender_keys, receiver_keys = self._keys()
        clean = self.at.clean_activations(pairs, sender_keys)
        reqs = [Request(tokens=p.corrupt_ids, continuations=p.continuations) for p in pairs]
        by_len = defaultdict(list)  # the corrupt run's forwards, by length
        for b, r in enumerate(reqs):
            for f in forwards(r):
                by_len[len(f.tokens)].append((b, f))
        keys = list(dict.fromkeys(sender_keys + receiver_keys))
        groups = list(by_len.values())
        outputs: list = [None] * len(groups)  # per group of forwards, its senders' clean - corrupt outputs
        total = None
        for k in range(steps):
            for g, items in enumerate(groups):
                rows = torch.tensor([b for b, _ in items], device=self.at.device)
                acts, objective = self._forward(reqs, items, keys, clean, k / steps if k else None, n)
                if outputs[g] is None:  # from the corrupt run itself (k = 0)
                    outputs[g] = self._sender_outputs(clean, acts, rows, n)
                grads = self._receiver_grads(acts, objective, n)  # [forwards, n, receivers, d_model]
                got = self._contract(outputs[g], grads, per_position)
                if total is None:
                    total = torch.zeros(len(pairs), *got.shape[1:], dtype=got.dtype, device=got.device)
                total.index_add_(0, rows, got)  # a pair's forwards add up
        return list(total * self.mask / steps)

    def _forward(self, reqs, items, keys, clean, alpha, n):
        """The corrupt forwards `items`, or with `alpha` the forwards whose input is the corrupt input
        moved `alpha` of the way to the clean one over the prompt (EAP-IG); its activations at `keys`
        in the graph and the objective."""
        if alpha is None:
            return self.at.corrupt_forward(reqs, items, keys, False)
        rows = [b for b, _ in items]
        delta = {}

        def interpolate(mod, args):
            x = args[0].detach().clone()
            x[:, :n] += alpha * (clean["resid_pre.0"][rows].to(x.dtype) - x[:, :n])
            delta["x"] = x.requires_grad_(True)
            return (delta["x"],) + tuple(args[1:])

        layer0 = site_module(self.at.model, self.shape.family, "resid_pre", 0)
        handle = layer0.register_forward_pre_hook(interpolate)
        try:
            return self.at.corrupt_forward(reqs, items, keys, False)
        finally:
            handle.remove()

    def _sender_outputs(self, clean, acts, rows, n) -> torch.Tensor:
        """[forwards, n, senders, d_model]: each sender's clean - corrupt output over the prompt, for
        the forwards of pairs `rows`."""
        acc = self.at.acc

        def delta(key):
            return clean[key][rows] - acts[key][:, :n].detach().to(acc)

        parts = [delta("resid_pre.0").unsqueeze(2)]
        for layer in range(self.shape.n_layers):
            parts.append(self._head_outputs(delta(site_key("head", layer)), layer))
            parts.append(delta(site_key("mlp_out", layer)).unsqueeze(2))
        return torch.cat(parts, dim=2)

    def _head_outputs(self, dz: torch.Tensor, layer: int) -> torch.Tensor:
        """[pairs, n, heads, d_model]: each head's slice of `dz` through the output projection alone
        (the projection's bias, which no head owns, cancels)."""
        H, hd = self.shape.n_heads, self.shape.head_dim
        o_proj = site_module(self.at.model, self.shape.family, "head", layer)
        B, n, _ = dz.shape
        one = torch.zeros(B, n, H, H, hd, dtype=dz.dtype, device=dz.device)
        idx = torch.arange(H, device=dz.device)
        one[:, :, idx, idx] = dz.view(B, n, H, hd)
        weight_dtype = next(o_proj.parameters()).dtype
        with torch.no_grad():
            each = o_proj(one.view(B, n, H, H * hd).to(weight_dtype))
            bias = o_proj(torch.zeros(1, H * hd, dtype=weight_dtype, device=dz.device))
        return (each - bias).to(self.at.acc)

    def _receiver_grads(self, acts, objective, n) -> torch.Tensor:
        """[forwards, n, receivers, d_model]: dM at each receiver's input over the prompt, in the
        graph's receiver order."""
        L, H, G = self.shape.n_layers, self.shape.n_heads, self.shape.kv_heads
        hd = self.shape.head_dim
        mlp_in = "resid_pre" if self.graph.parallel else "resid_mid"
        outs = [site_key(s, layer) for layer in range(L) for s in ("q", "k", "v", "mlp_out")]
        final = site_key("resid", L - 1)
        got = torch.autograd.grad(objective, [acts[k] for k in outs] + [acts[final]], retain_graph=True,
                                  allow_unused=True)
        grad = dict(zip(outs + [final], got))
        parts = []
        for layer in range(L):
            stream = acts[site_key("resid_pre", layer)]
            for site, units in (("q", H), ("k", G), ("v", G)):
                key = site_key(site, layer)
                parts += list(self._back(acts[key], stream, grad[key], units, hd, n).unbind(2))
            key = site_key("mlp_out", layer)
            parts += list(self._back(acts[key], acts[site_key(mlp_in, layer)], grad[key], 0, 0, n).unbind(2))
        g = grad[final]
        parts.append((torch.zeros_like(acts[final]) if g is None else g)[:, :n].detach().to(self.at.acc))
        return torch.stack(parts, dim=2)

    def _back(self, out, stream, g, units: int, width: int, n: int) -> torch.Tensor:
        """The gradient `g` at `out` carried back to `stream` along the paths from `stream` to `out`,
        each unit's columns (`units` of `width`; 0: the whole of `out` as one) on its own:
        [forwards, n, units or 1, d_model]. One backward pass for every unit (autograd's batched
        gradients)."""
        count = max(units, 1)
        if g is None:
            return torch.zeros(stream.shape[0], n, count, stream.shape[-1], dtype=self.at.acc, device=stream.device)
        if units:
            each = torch.zeros(units, *g.shape, dtype=g.dtype, device=g.device)
            for u in range(units):
                each[u, ..., u * width:(u + 1) * width] = g[..., u * width:(u + 1) * width]
        else:
            each = g.unsqueeze(0)
        (back,) = torch.autograd.grad(out, stream, grad_outputs=each, retain_graph=True, allow_unused=True,
                                      is_grads_batched=True)
        if back is None:
            return torch.zeros(stream.shape[0], n, count, stream.shape[-1], dtype=self.at.acc, device=stream.device)
        return back[:, :, :n].detach().to(self.at.acc).permute(1, 2, 0, 3)

    def _contract(self, outputs, grads, per_position: bool) -> torch.Tensor:
        """[rows, n, S, d] x [rows, n, R, d] -> [rows, S, R] (or [rows, n, S, R])."""
        if per_position:
            return torch.einsum("btsd,btrd->btsr", outputs, grads)
        return torch.einsum("btsd,btrd->bsr", outputs, grads)


def longest_answer(pairs, idx) -> int:
    """The most tokens a forward of pairs `idx` scores past its prompt (answers scored whole)."""
    return max((len(c) - 1 for i in idx for c in pairs[i].continuations), default=0)


def edge_scorer_for(attributor) -> EdgeScorer:
    """An EdgeScorer on an Attributor, made once per Attributor."""
    made = getattr(attributor, "_edge_scorer", None)
    if made is None:
        made = attributor._edge_scorer = EdgeScorer(attributor)
    return made
