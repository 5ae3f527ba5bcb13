"""The hooks that read and write each site where vLLM holds it.

Sites are read and written where vLLM holds them: a layer's output (the (hidden, residual) pair
of a split family summed, or written whole into one half with the other zeroed), a module's input
(z at o_proj, the neurons at the down projection, resid_pre at the layer, resid_mid at the norm
before the MLP, or the MLP where none precedes it), and q, k, v where the attention-kernel module
receives them after the rotary embedding. The attention pattern never exists outside the fused
kernels: it is computed here from the q and k the kernel receives, with the kernel's own scale,
window and soft-cap (patterns.pattern_rows). Families vLLM runs through its Transformers backend
(sites.Family.vllm_transformers) hold a batch dim of one, which the hooks never see (`unbatched`).

Every write goes through `put`, which checks that what it writes lives where the activations live.
Captures are copied out of the activations into each request's buffer on the CPU.
"""
from __future__ import annotations

import torch

from ...model.sites import QKV, SITES, get_module, parse_key, site_key, site_module
from ..patterns import knocked_out, patched_head, pattern_rows


def put(t: torch.Tensor, index, values: torch.Tensor, what: str) -> None:
    """t[index] = values, refusing values or indices that live elsewhere than t (on a GPU an index
    write from the CPU fails or copies per hook). Rows given as one index tensor are copied with
    `index_copy_` (on the CPU about three times faster than indexed assignment, which goes through
    the general advanced-indexing kernel)."""
    _same_device(t, index, values, what)
    if isinstance(index, tuple):
        t[index] = values
    else:
        t.index_copy_(0, index, values.to(t.dtype))


def _same_device(t, index, values, what):
    for x in (index if isinstance(index, tuple) else (index,)) + (values,):
        if x.device != t.device:
            raise RuntimeError(f"patchgrid worker: {what} writes a tensor on {x.device} into activations on "
                               f"{t.device}")


def unbatched(hook, batched: bool):
    """`hook` as a module hook. vLLM's Transformers backend calls transformers' modules with a batch of
    one ([1, tokens, ...]) where the hooks expect vLLM's flattened rows ([tokens, ...]): with `batched`
    the hook sees views without the batch dim (its writes land in the real tensors), and a tensor it
    returns gets the batch dim back."""
    if not batched:
        return hook

    def row(x):
        if not isinstance(x, torch.Tensor):
            return x
        if x.dim() < 2 or x.shape[0] != 1:
            raise RuntimeError(f"patchgrid worker: expected a batch of one from vLLM's Transformers backend, got a "
                               f"tensor of shape {tuple(x.shape)}")
        return x[0]

    def each(f, x):
        return tuple(f(t) for t in x) if isinstance(x, tuple) else f(x)

    def batch(x):
        return x.unsqueeze(0) if isinstance(x, torch.Tensor) else x

    def wrapped(module, *io):  # (args,) for a pre-hook, (args, output) for a forward hook
        got = hook(module, *(each(row, x) for x in io))
        return None if got is None else each(batch, got)

    return wrapped


class Wrapped:
    """A module's `forward` with a pre-hook run first (marks it as patchgrid's); `forward` is the one
    it wraps. With `with_kwargs` the hook sees (module, args, kwargs) and changes nothing."""

    def __init__(self, module, forward, hook, with_kwargs: bool = False):
        self.module, self.forward, self.hook, self.with_kwargs = module, forward, hook, with_kwargs

    def __call__(self, *args, **kwargs):
        if self.with_kwargs:
            self.hook(self.module, args, kwargs)
            return self.forward(*args, **kwargs)
        new = self.hook(self.module, args)
        return self.forward(*(args if new is None else new), **kwargs)


class ForwardHook:
    """A pre-hook on whatever calls the module: its `forward` attribute is replaced on this instance
    (module hooks fire only for calls through the module itself). `remove` puts back what was there:
    nothing (the class's forward), or a forward of the instance's own (vLLM rebinds some)."""

    def __init__(self, module, hook, with_kwargs: bool = False):
        self.module = module
        self.own = module.__dict__.get("forward")
        module.forward = Wrapped(module, module.forward, hook, with_kwargs)

    def remove(self):
        if self.own is None:
            del self.module.forward
        else:
            self.module.forward = self.own


class SiteHooks:
    """The site hooks of a call (mixed into session.Session, whose state they read: `model`,
    `family`, `widths`, `embed_scale`, `handles`, and `step`, the current step's Step). The logits
    hook is readout.LogitsReadout's; `_begin_step` plans each step (step.plan_step)."""

    def _pre(self, module, hook):
        self.handles.append(module.register_forward_pre_hook(unbatched(hook, self.family.vllm_transformers)))

    def _post(self, module, hook):
        self.handles.append(module.register_forward_hook(unbatched(hook, self.family.vllm_transformers)))

    def _install(self, keys):
        m, fam = self.model, self.family
        embed = get_module(m, fam.embed)
        # The embedding is the first module every forward calls (the decoder module itself is
        # wrapped by vLLM's compile decorator, which bypasses module hooks).
        self._pre(embed, self._begin_step)
        self._post(embed, self._on_embed)
        # The final norm's output is what the unembedding reads: its rows at the last prompt position
        # and over the continuations are unembedded here, in float32 (readout.LogitsReadout).
        self._post(get_module(m, fam.final_norm), self._on_final)
        attention = set()  # layers whose q, k or v are read or written
        for key in keys - {"embed"}:  # the embedding's hooks above handle embed
            site, layer = parse_key(key)
            module = site_module(m, fam, site, layer)
            if SITES[site].at == "attention":
                attention.add(layer)
            else:
                self._install_site(key, site, module)
        if self.circuit_layout is not None:  # a circuit run puts its receivers' q, k, v in at every layer
            attention = set(range(len(get_module(m, fam.layers))))
        for layer in attention:
            kernel = get_module(site_module(m, fam, "q", layer), fam.attn_kernel)
            # Its input is [tokens, heads * head_dim] in every family; vLLM's Transformers backend
            # calls its `forward` directly, so the hook runs from there, not as a module hook.
            self.handles.append(ForwardHook(kernel, self._make_attention_hook(layer)))

    def _install_site(self, key, site, module):
        fam = self.family
        if SITES[site].at == "input" and SITES[site].unit is None:
            # the stream a layer or its MLP's norm reads: (hidden, residual) in a split family (a
            # family without a mid-stack start names no stream_arg; its layers read the stream first)
            index = (fam.stream_arg or 0) if SITES[site].module == "layer" else 0
            self._pre(module, self._make_stream_input_hook(key, index, fam.split_residual))
        elif SITES[site].at == "input":
            self._pre(module, self._make_input_hook(key))
        elif site == "resid" and fam.split_residual:
            self._post(module, self._make_split_stream_hook(key))
        else:
            self._post(module, self._make_out_hook(key))

    def _capture(self, key, stream_fn):
        for row0, row1, buf, pos0 in self.step.captures.get(key, ()):
            buf[pos0:pos0 + row1 - row0] = stream_fn(row0, row1)

    def _on_embed(self, module, args, out):
        step = self.step
        w = step.writes.get("embed")
        if w is None and step.noise is None and "embed" not in step.captures:
            return None
        out = out.clone()  # the embedding output may alias the layer-0 residual
        scale = self.embed_scale
        if w is not None:
            put(out, w[0], w[1] if scale is None else w[1] / scale, "embed")
        if step.noise is not None:
            rows, vals = step.noise
            put(out, rows, out.index_select(0, rows) + (vals if scale is None else vals / scale), "noise")
        self._capture("embed", lambda a, b: out[a:b] if scale is None else out[a:b] * scale)
        return out

    def _make_split_stream_hook(self, key):
        """A layer whose output is (hidden, residual), the stream being their sum."""

        def hook(module, args, out):
            hidden, residual = out
            w = self.step.writes.get(key)
            if w is not None:
                # Write the whole stream into one half and zero the other, so the next
                # layer's fused add sees exactly the patched value.
                put(hidden, w[0], w[1], key)
                put(residual, w[0], torch.zeros_like(w[1]), key)
            self._capture(key, lambda a, b: hidden[a:b] + residual[a:b])
            return None

        return hook

    def _make_out_hook(self, key):
        def hook(module, args, out):
            t = out[0] if isinstance(out, tuple) else out
            w = self.step.writes.get(key)
            if w is not None:
                put(t, w[0], w[1], key)
            self._capture(key, lambda a, b: t[a:b])
            return None

        return hook

    def _make_stream_input_hook(self, key, index: int, split: bool):
        """The whole stream a module reads: resid_pre (a layer's input) or resid_mid (the MLP norm's).
        In a split family it reads (hidden, residual) at `index`, `index + 1`, the stream being their
        sum (residual is None where layer 0 reads the embedding alone): a write puts the whole stream
        into copies of hidden and a zeroed residual. Elsewhere the module's own input is written in
        place, since the layer keeps that very tensor as its residual."""

        def hook(module, args):
            hidden = args[index]
            residual = args[index + 1] if split else None
            w = self.step.writes.get(key)
            if w is not None and residual is not None:
                hidden, residual = hidden.clone(), residual.clone()
                put(hidden, w[0], w[1], key)
                put(residual, w[0], torch.zeros_like(w[1]), key)
            elif w is not None:
                put(hidden, w[0], w[1], key)
            if residual is None:
                self._capture(key, lambda a, b: hidden[a:b])
            else:
                self._capture(key, lambda a, b: hidden[a:b] + residual[a:b])
            if w is not None and residual is not None:
                return args[:index] + (hidden, residual) + args[index + 2:]
            return None

        return hook

    def _make_attention_hook(self, layer: int):
        """q, k and v as vLLM's attention kernel receives them ([tokens, heads * head_dim], after the
        rotary embedding): a patch writes one head's columns of a copy; the pattern, where captured,
        is computed from the q and k it receives (patterns.pattern_rows)."""
        keys = [site_key(site, layer) for site in QKV]
        hd = self.widths["unit_width"]["head"]
        pattern = site_key("pattern", layer)

        def hook(module, args):
            out = list(args[:3])
            if self.circuit_layout is not None:
                out = self._circuit_kernel(layer, out)
            for i, key in enumerate(keys):
                w = self.step.units.get(key)
                if w is not None:
                    rows, units, vals = w
                    out[i] = out[i].clone()
                    put(out[i].view(out[i].shape[0], -1, hd), (rows, units), vals, key)
                self._capture(key, lambda a, b, t=out[i]: t[a:b])
            if pattern in self.step.captures:
                self._capture_pattern(module, pattern, out[0], out[1], hd)
            if self.step.attention_rows:
                self._recompute(module, layer, out, hd)
            if all(a is b for a, b in zip(out, args)):
                return None
            return tuple(out) + tuple(args[3:])

        return hook

    def _recompute(self, kernel, layer: int, qkv, hd: int) -> None:
        """The heads' outputs this layer's pattern patches and knockouts change (patterns.attend), from
        the q, k and v the kernel receives, each request's keys and values kept across the steps
        chunked prefill splits its prompt into; queued for the output projection's hook (head.L)."""
        scale, window, softcap = _kernel_mask(kernel)
        query, key, value = qkv
        queued = self.step.recomputed.setdefault(site_key("head", layer), [])
        for r, row0, pos0, pos1 in self.step.attention_rows:
            if not r.recomputes(layer):
                continue
            held = r.held_kv.get(layer)
            if held is None:
                held = r.held_kv[layer] = tuple(torch.zeros(r.n_tokens, t.shape[1], dtype=t.dtype, device=t.device)
                                                for t in (key, value))
            held[0][pos0:pos1] = key[row0:row0 + pos1 - pos0]
            held[1][pos0:pos1] = value[row0:row0 + pos1 - pos0]
            keys, values = (t.view(r.n_tokens, -1, hd) for t in held)
            for pos, head, weights in r.pattern_patches.get(layer, ()):
                sel = [k for k, q in enumerate(pos) if pos0 <= q < pos1]
                if sel:
                    z = patched_head(weights[sel].to(value.device), values, head, query.shape[1] // hd)
                    rows = torch.tensor([row0 + pos[k] - pos0 for k in sel], device=value.device)
                    queued.append((rows, torch.full_like(rows, head), z.to(value.dtype)))
            if r.knockout is not None and layer in r.knockout[0]:
                for q in (q for q in r.knockout[1] if pos0 <= q < pos1):
                    row = row0 + q - pos0
                    z = knocked_out(query[row].view(-1, hd), keys, values, q, r.knockout[2], scale, window, softcap)
                    queued.append((torch.tensor([row], device=value.device), None, z.to(value.dtype)))

    def _capture_pattern(self, kernel, key: str, query, keys, hd: int) -> None:
        """Each capturing request's rows of the pattern: its queries this step over its keys so far (kept
        across the steps chunked prefill splits a prompt into), into [tokens, heads * tokens]."""
        scale, window, softcap = _kernel_mask(kernel)
        for row0, row1, buf, pos0 in self.step.captures[key]:
            n = buf.shape[0]
            held = self.pattern_keys.get(id(buf))
            if held is None:
                held = self.pattern_keys[id(buf)] = torch.zeros(n, keys.shape[1], dtype=keys.dtype, device=keys.device)
            held[pos0:pos0 + row1 - row0] = keys[row0:row1]
            w = pattern_rows(query[row0:row1].view(row1 - row0, -1, hd), held[:pos0 + row1 - row0].view(
                pos0 + row1 - row0, -1, hd), pos0, scale, window, softcap)  # [rows, heads, keys so far]
            rows = torch.zeros(row1 - row0, w.shape[1], n, dtype=torch.float32, device=w.device)
            rows[:, :, :w.shape[2]] = w
            buf[pos0:pos0 + row1 - row0] = rows.flatten(1).to(buf.dtype).to(buf.device)

    def _make_input_hook(self, key):
        """z (o_proj's input) or the neurons (the down projection's input): a patch writes one
        head's slice of it, or one neuron's column, or the whole of it."""
        site = parse_key(key)[0]
        uw = self.widths["unit_width"][SITES[site].unit]

        def hook(module, args):
            z = args[0]
            w = self.step.writes.get(key)
            if w is not None:
                put(z, w[0], w[1], key)
            w = self.step.units.get(key)
            if w is not None:
                rows, units, vals = w
                put(z.view(z.shape[0], -1, uw), (rows, units), vals, key)
            for rows, units, vals in self.step.recomputed.get(key, ()):  # heads' outputs recomputed
                if units is None:
                    put(z, rows, vals, key)
                else:
                    put(z.view(z.shape[0], -1, uw), (rows, units), vals, key)
            self._capture(key, lambda a, b: z[a:b])
            return None

        return hook


def _kernel_mask(kernel) -> tuple[float, int | None, float | None]:
    """(scale, sliding window or None, soft-cap or None) of vLLM's attention kernel module, as it
    computes its weights."""
    impl = kernel.impl
    window = impl.sliding_window if impl.sliding_window and impl.sliding_window > 0 else None
    return impl.scale, window, impl.logits_soft_cap or None
