"""Circuit runs inside vLLM's forward (backends.edge_ablation says what is computed), on the rows of
each step's circuit requests.

Per layer: the layer's pre-hook keeps the stream it reads (at layer 0 the input sender's delta is
recorded); a wrapper on the attention module's `forward` (vLLM calls it with keywords) runs the
attention norm and the module itself on each changed receiver input, stacked with its positions
repeated, stopped at the attention kernel once q, k and v are read (edge_ablation.Abort; nothing is
written to the KV cache), and leaves each receiver's head slice for the real call's kernel hook
(`_circuit_kernel`), so the KV cache holds what attention read; the output projection's pre-hook
turns the change in z into the heads' deltas; the MLP norm's pre-hook keeps resid_mid, the MLP's
pre-hook replaces a changed mlp_in's rows, its hook records the MLP's delta; the final norm's
pre-hook gives the logits their own input. Mixed into session.Session (its `model`, `family`,
`step`, `handles`, `sources`, `dtype`, `device`, `widths`).
"""
from __future__ import annotations

import torch

from ...methods.graph import EdgeGraph, circuit_keys
from ...model.sites import get_module
from ..edge_ablation import Ablation, Abort, Layout, head_outputs, receiver_qkv
from .hooks import ForwardHook


class CircuitHooks:
    def _install_circuit(self, n_heads: int, n_kv_heads: int) -> None:
        m, fam = self.model, self.family
        layers = get_module(m, fam.layers)
        graph = EdgeGraph(len(layers), n_heads, n_kv_heads, fam.mlp_norm is None)
        self.circuit_layout = Layout(graph, self.device)
        self._circuit_stream = self._circuit_mid = None
        self._circuit_capturing = None
        self._circuit_slices: dict[int, list] = {}
        for layer, block in enumerate(layers):
            self._pre(block, self._circuit_on_layer(layer))
            self.handles.append(ForwardHook(get_module(block, fam.attn), self._circuit_on_attention(layer, block),
                                            with_kwargs=True))
            self._pre(get_module(block, fam.o_proj), self._circuit_on_z(layer, block))
            self._pre(get_module(block, fam.mlp_norm), self._circuit_on_mid)
            mlp = get_module(block, fam.mlp)
            self._pre(mlp, self._circuit_on_mlp_in(layer, block))
            self._post(mlp, self._circuit_on_mlp_out(layer))
        self._pre(get_module(m, fam.final_norm), self._circuit_on_final)

    def _circuit_begin_step(self) -> None:
        """This step's circuit rows: (rows in the batch, Ablation, the source's values at their positions)."""
        layout, out = self.circuit_layout, []
        for r, row0, pos0, pos1 in self.step.circuit_rows:
            if r.ablated is None:
                r.ablated = layout.ablated(r.circuit[1])
            src = {}
            for key in circuit_keys(layout.graph.n_layers):
                first = self.sources.first[(r.circuit[0], key)]
                rows = torch.tensor([first + row for row in r.tree[pos0:pos1]], dtype=torch.long)
                src[key] = self.sources.rows[key].index_select(0, rows).to(self.device, torch.float32)
            batch_rows = torch.arange(row0, row0 + pos1 - pos0, device=self.device)
            out.append((batch_rows, Ablation(layout, r.ablated, pos1 - pos0, self.widths["d_model"], self.device), src))
        self.step.circuits = out

    def _stream_of(self, args, index: int) -> torch.Tensor:
        hidden = args[index]
        residual = args[index + 1] if self.family.split_residual and len(args) > index + 1 else None
        return hidden if residual is None else hidden + residual

    def _circuit_on_layer(self, layer):
        index = self.family.stream_arg or 0

        def hook(module, args):
            if not self.step.circuits:
                return None
            self._circuit_stream = self._stream_of(args, index)
            if layer == 0:
                for rows, ab, src in self.step.circuits:
                    ab.add(0, (src["resid_pre.0"] - self._circuit_stream[rows].float())[None])
            return None
        return hook

    def _circuit_on_attention(self, layer, block):
        norm = get_module(block, self.family.attn_norm)
        hd = self.widths["unit_width"]["head"]

        def hook(module, args, kwargs):
            self._circuit_slices[layer] = []
            stream = self._circuit_stream
            for rows, ab, _ in self.step.circuits:
                receivers = ab.receives(self.circuit_layout.attention_receivers(layer))
                if not receivers:
                    continue
                x = ab.inputs(stream[rows], receivers)  # [R, rows, d_model]
                x = norm.forward(x.reshape(-1, x.shape[-1]).to(self.dtype))
                a, kw = _stacked(args, kwargs, x, rows, len(receivers), stream.shape[0])
                self._circuit_capturing = ()
                try:
                    module.forward.forward(*a, **kw)  # the module's own forward, past this wrapper
                    raise RuntimeError(f"patchgrid worker: layer {layer}'s attention ran past its kernel")
                except Abort:
                    pass
                captured, self._circuit_capturing = self._circuit_capturing, None
                self._circuit_slices[layer].append(
                    (rows, receiver_qkv(captured, receivers, self.circuit_layout, len(rows), hd)))
        return hook

    def _circuit_kernel(self, layer, out: list) -> list:
        """q, k, v [tokens, heads * head_dim] at the attention kernel: read (and stopped) in a capture
        call; each receiver's head slice put into copies otherwise."""
        if self._circuit_capturing is not None:
            self._circuit_capturing = tuple(out[:3])
            raise Abort
        hd = self.widths["unit_width"]["head"]
        cloned = [False] * 3
        for rows, slices in self._circuit_slices.get(layer, ()):
            for (site, head), val in slices.items():
                i = "qkv".index(site)
                if not cloned[i]:
                    out[i], cloned[i] = out[i].clone(), True
                out[i].view(out[i].shape[0], -1, hd)[rows, head] = val.to(out[i].dtype)
        return out

    def _circuit_on_z(self, layer, block):
        o_proj = get_module(block, self.family.o_proj)
        first = self.circuit_layout.head_senders(layer)
        n_heads = self.circuit_layout.graph.n_heads

        def hook(module, args):
            z = args[0]
            for rows, ab, src in self.step.circuits:
                dz = (src[f"head.{layer}"] - z[rows].float()).to(z.dtype)
                ab.add(first, head_outputs(o_proj.forward, dz, n_heads))
            return None
        return hook

    def _circuit_on_mid(self, module, args):
        if self.step.circuits:
            self._circuit_mid = self._stream_of(args, 0)

    def _circuit_on_mlp_in(self, layer, block):
        norm = get_module(block, self.family.mlp_norm)
        r = self.circuit_layout.mlp_receiver(layer)

        def hook(module, args):
            x = None
            for rows, ab, _ in self.step.circuits:
                if ab.receives([r]):
                    x = args[0].clone() if x is None else x
                    x[rows] = norm.forward(ab.inputs(self._circuit_mid[rows], [r])[0].to(x.dtype))
            return None if x is None else (x,) + tuple(args[1:])
        return hook

    def _circuit_on_mlp_out(self, layer):
        sender = self.circuit_layout.mlp_sender(layer)

        def hook(module, args, out):
            t = out[0] if isinstance(out, tuple) else out
            for rows, ab, src in self.step.circuits:
                ab.add(sender, (src[f"mlp_out.{layer}"] - t[rows].float())[None])
            return None
        return hook

    def _circuit_on_final(self, module, args):
        if not self.step.circuits:
            return None
        r = self.circuit_layout.logits_receiver
        split = self.family.split_residual and len(args) > 1 and args[1] is not None
        stream = self._stream_of(args, 0)
        hidden = residual = None
        for rows, ab, _ in self.step.circuits:
            if ab.receives([r]):
                if hidden is None:
                    hidden = args[0].clone()
                    residual = args[1].clone() if split else None
                hidden[rows] = ab.inputs(stream[rows], [r])[0].to(hidden.dtype)
                if split:
                    residual[rows] = 0
        if hidden is None:
            return None
        return (hidden, residual) + tuple(args[2:]) if split else (hidden,) + tuple(args[1:])


def _stacked(args, kwargs, x, rows, n: int, n_tokens: int):
    """The attention module's call with its hidden states `x` (n receivers' rows stacked) and every
    other per-token argument (the positions) taken at `rows` and repeated n times."""
    def each(v, hidden):
        if hidden:
            return x
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[-1] == n_tokens and v.dim() <= 2:
            return v[..., rows].repeat(*([1] * (v.dim() - 1)), n)  # positions [tokens] or [sections, tokens]
        return v

    def is_hidden(v):
        return isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() == 2 and v.shape[0] == n_tokens

    a = tuple(each(v, is_hidden(v)) for v in args)
    kw = {k: each(v, k == "hidden_states" or (k != "positions" and is_hidden(v))) for k, v in kwargs.items()}
    return a, kw
