"""The hf backend's circuit runs (backends.edge_ablation says what is computed): module hooks on
transformers' layers, written for obviousness, one batch row at a time.

Per layer: the layer's pre-hook keeps the stream it reads (and at layer 0 records the input
sender's delta); the attention module's pre-hook runs the attention norm and the module itself on
each changed receiver input (the batch row repeated per receiver, no KV cache), stopped at the
attention function once q, k and v are read (edge_ablation.Abort), and leaves each receiver's head
slice for the real call's attention function (`at_attention`); the output projection's pre-hook
turns the change in z into the heads' deltas; the MLP norm's pre-hook keeps resid_mid, the MLP's
pre-hook replaces its input for a changed mlp_in, and its hook records the MLP's delta; the final
norm's pre-hook gives the logits their own input.
"""
from __future__ import annotations

import torch

from ..methods.graph import circuit_keys
from ..model.sites import get_module
from ..plan import tree_rows
from .edge_ablation import Ablation, Abort, head_outputs, receiver_qkv

_BATCHED_KWARGS = ("attention_mask", "position_ids", "position_embeddings")


class BatchCircuit:
    def __init__(self, batch, sources, shape, layout, device, dtype):
        self.shape, self.layout, self.dtype = shape, layout, dtype
        self.fam = shape.family
        n = len(batch[0][1].tokens)
        self.items = []  # (batch row, Ablation, {key: source values [tokens, width]})
        for b, (r, f) in enumerate(batch):
            if r.circuit is None:
                continue
            rows = torch.tensor(tree_rows(f, len(r.tokens)))  # the source's rows of this forward's positions
            src = {k: sources[r.circuit.source][k][rows].to(device, torch.float32)
                   for k in circuit_keys(shape.n_layers)}
            self.items.append((b, Ablation(layout, layout.ablated(r.circuit.kept), n, shape.d_model, device), src))
        self.stream = self.mid = None
        self.capturing = None  # the q, k, v of a capture-and-abort call, once read
        self.overrides: dict[int, list] = {}  # layer -> [(batch row, {(site, head): [tokens, head_dim]})]

    def install(self, m, handles) -> None:
        fam = self.fam
        for layer, block in enumerate(get_module(m, fam.layers)):
            handles.append(block.register_forward_pre_hook(self._on_layer(layer), with_kwargs=True))
            attn = get_module(block, fam.attn)
            handles.append(attn.register_forward_pre_hook(self._on_attention_module(layer, attn, block),
                                                          with_kwargs=True))
            handles.append(get_module(block, fam.o_proj).register_forward_pre_hook(self._on_z(layer, block)))
            handles.append(get_module(block, fam.mlp_norm).register_forward_pre_hook(self._on_mid))
            mlp = get_module(block, fam.mlp)
            handles.append(mlp.register_forward_pre_hook(self._on_mlp_in(layer, block)))
            handles.append(mlp.register_forward_hook(self._on_mlp_out(layer)))
        handles.append(get_module(m, fam.final_norm).register_forward_pre_hook(self._on_final))

    def _on_layer(self, layer):
        def hook(module, args, kwargs):
            self.stream = args[0] if args else kwargs["hidden_states"]
            if layer == 0:
                for b, ab, src in self.items:
                    ab.add(0, (src["resid_pre.0"] - self.stream[b].float())[None])
        return hook

    def _on_attention_module(self, layer, attn, block):
        norm = get_module(block, self.fam.attn_norm)

        def hook(module, args, kwargs):
            self.overrides[layer] = []
            for b, ab, _ in self.items:
                receivers = ab.receives(self.layout.attention_receivers(layer))
                if not receivers:
                    continue
                x = norm.forward(ab.inputs(self.stream[b], receivers).to(self.dtype))  # [R, tokens, d]
                kw = {k: _rows(v, b, len(receivers)) if k in _BATCHED_KWARGS else v for k, v in kwargs.items()
                      if k not in ("hidden_states", "past_key_values", "past_key_value", "layer_past")}
                self.capturing = ()
                try:
                    attn.forward(x, *args[1:], **kw)
                    raise RuntimeError(f"patchgrid hf: layer {layer}'s attention ran past its q, k and v")
                except Abort:
                    pass
                qkv = [t.transpose(1, 2).reshape(-1, t.shape[1] * t.shape[3]) for t in self.capturing]
                self.capturing = None
                self.overrides[layer].append(
                    (b, receiver_qkv(qkv, receivers, self.layout, x.shape[1], self.shape.head_dim)))
            return None
        return hook

    def at_attention(self, layer, query, key, value):
        """q, k, v [batch, heads, tokens, head_dim] as the attention function receives them: captured
        (and stopped) in a capture call, each receiver's head slice put in otherwise."""
        if self.capturing is not None:
            self.capturing = (query, key, value)
            raise Abort
        out, cloned = [query, key, value], [False] * 3
        for b, slices in self.overrides.get(layer, ()):
            for (site, head), val in slices.items():
                i = "qkv".index(site)
                if not cloned[i]:
                    out[i], cloned[i] = out[i].clone(), True
                out[i][b, head] = val.to(out[i].dtype)
        return tuple(out)

    def _on_z(self, layer, block):
        o_proj = get_module(block, self.fam.o_proj)

        def hook(module, args):
            z = args[0]
            for b, ab, src in self.items:
                dz = (src[f"head.{layer}"] - z[b].float()).to(z.dtype)
                ab.add(self.layout.head_senders(layer), head_outputs(o_proj.forward, dz, self.shape.n_heads))
        return hook

    def _on_mid(self, module, args):
        self.mid = args[0]

    def _on_mlp_in(self, layer, block):
        norm = get_module(block, self.fam.mlp_norm)
        r = self.layout.mlp_receiver(layer)

        def hook(module, args):
            x = None
            for b, ab, _ in self.items:
                if ab.receives([r]):
                    x = args[0].clone() if x is None else x
                    x[b] = norm.forward(ab.inputs(self.mid[b], [r])[0].to(self.dtype))  # past _on_mid
            return None if x is None else (x,) + tuple(args[1:])
        return hook

    def _on_mlp_out(self, layer):
        def hook(module, args, out):
            t = out[0] if isinstance(out, tuple) else out
            for b, ab, src in self.items:
                ab.add(self.layout.mlp_sender(layer), (src[f"mlp_out.{layer}"] - t[b].float())[None])
        return hook

    def _on_final(self, module, args):
        r = self.layout.logits_receiver
        x = None
        for b, ab, _ in self.items:
            if ab.receives([r]):
                x = args[0].clone() if x is None else x
                x[b] = ab.inputs(args[0][b], [r])[0].to(x.dtype)
        return None if x is None else (x,) + tuple(args[1:])


def _rows(v, b: int, n: int):
    """Batch row `b` of a keyword argument, repeated `n` times along the batch (tuples: each)."""
    if isinstance(v, tuple):
        return tuple(_rows(x, b, n) for x in v)
    if isinstance(v, torch.Tensor) and v.dim() >= 2:  # a batch of one is broadcast over the batch
        return v[(b if v.shape[0] > 1 else 0):][:1].expand(n, *v.shape[1:])
    return v
