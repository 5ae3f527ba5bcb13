"""The part of the vLLM backend that runs inside vLLM's worker (a worker extension).

Per engine call: `pg_begin` receives the patch sources and installs hooks; vLLM then runs its
scheduler steps, each a flattened batch of rows from many requests; `pg_end` removes the hooks
and returns results keyed by each request's tag.

At every step a pre-hook on the model maps this step's rows to requests (batch order is not
submission order, and chunked prefill may split one prompt across steps), and turns every plan
into one vectorised write (rows, values) per site, so the layer hooks do one indexed copy each.
Plans and values are put together on the CPU and moved to the activations' device once per step;
every write checks that what it writes lives where the activations live. Captures go to the CPU.

A patchgrid request whose answers are scored whole is several vLLM requests, one per forward
(plan.forwards): the prompt followed by one continuation's inputs. Patches and noise address the
prompt's positions only. Logits are read at every row from the last prompt position on: vLLM
unembeds each request's last row itself (a hook on its logits processor takes them), and a hook
on the final norm unembeds the rows before it; there the worker reads the answers' logits and
ranks, the continuations' log-probabilities, and the KL divergence from the reference
log-probabilities the call's sources hold.

Sites are read and written where vLLM holds them: a layer's output (the (hidden, residual) pair
of a split family summed, or written whole into one half with the other zeroed), a module's input
(z at o_proj, the neurons at the down projection, resid_pre at the layer, resid_mid at the norm
before the MLP, or the MLP where none precedes it), and q, k, v where the attention-kernel module
receives them after the rotary embedding. The attention pattern never exists outside the fused
kernels and cannot be read here. Families vLLM runs through its Transformers backend
(sites.Family.vllm_transformers) hold a batch dim of one, which the hooks never see (`_unbatched`).

A call whose requests all start at layer S (plan.Start) sets the decoder's `start_layer` to S for
the call: vLLM's decoders loop over `layers[start_layer:]`, so nothing below S runs, and a
pre-hook on layer S hands it, row by row, the cached stream entering S (with any patch on that
stream written in). The start layer is put back when the call ends, however it ends. Transformers'
decoders (vLLM's Transformers backend) loop over every layer instead: the layers below S are swapped
for stand-ins that pass the stream on, and put back likewise.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from ..metrics import answer_ranks, kl_divergence
from ..plan import (
    LOGPROBS,
    Forward,
    Noise,
    decode_tensor,
    encode_tensor,
    from_wire,
    gaussian_noise,
    patch_rows,
    stream_key,
    tree_rows,
)
from ..sites import FAMILIES, QKV, SITES, Family, get_module, parse_key, site_key, site_module
from ..tp import unit_owner, units_per_rank

PLAN_KEY = "patchgrid"


class _Request:
    """One vLLM request (a forward of a patchgrid request, plan.forwards): its plan and what it has
    gathered so far, kept across scheduler steps."""

    def __init__(self, plan: str, n_tokens: int, sources, references, widths, dtype, tp=(0, 1)):
        self.tag, req, (n_prompt, fwd) = from_wire(plan)
        self.answers = list(req.answers)
        self.top_k = req.top_k
        self.n_prompt = n_prompt  # patches and noise address the prompt's positions
        self.n_tokens = n_tokens  # the prompt and one continuation's inputs
        self.first = fwd.first
        self.logprobs = req.logprobs
        self.reference = None if req.reference is None else references[req.reference]
        # (continuation index, its tokens): position n_prompt - 1 + k predicts token k
        self.scores = [(j, list(req.continuations[j])) for j in fwd.scores]
        self.scored = {j: [None] * len(c) for j, c in self.scores}
        self.readout: dict = {}
        # (key, unit (head or neuron) within this rank's slice or None, positions array,
        # values [len(positions), w])
        self.patches = []
        rank, tp_size = tp
        for p in req.patches:
            unit = p.unit
            if unit is not None:
                owner, unit = unit_owner(p.unit, widths["units"][SITES[p.site].unit], tp_size)
                if owner != rank:  # another rank holds this head's slice of z, or this neuron
                    continue
            pos, rows = patch_rows(p, n_prompt, n_tokens, fwd.branch)
            pos = np.asarray(pos, dtype=np.int64)
            vals = sources[p.source][p.key][torch.tensor(rows, dtype=torch.long)]
            if p.unit is not None:
                uw = widths["unit_width"][SITES[p.site].unit]
                vals = vals[:, p.unit * uw:(p.unit + 1) * uw]
            self.patches.append((p.key, unit, pos, vals))
        self.noise = []
        for z in req.noise:
            pos = np.asarray(z.positions, dtype=np.int64)
            self.noise.append((pos, gaussian_noise(Noise(tuple(pos), z.std, z.seed), widths["d_model"]).to(dtype)))
        self.captures = {key: torch.empty(n_tokens, widths[parse_key(key)[0]], dtype=dtype) for key in req.capture}
        self.start = req.start
        self.stream = None
        if req.start is not None:
            # the stream source holds the request's tree of rows: this forward's are its own
            rows = torch.tensor(tree_rows(Forward((0,) * n_tokens, (), fwd.branch, fwd.first), n_prompt))
            self.stream = sources[req.start.source][req.start.key][rows]

    def part(self) -> dict:
        """What this forward gives its request (plan.join_forwards), as plain data."""
        return {**self.readout, "scores": self.scored,
                "captures": {key: encode_tensor(v) for key, v in self.captures.items()}}


class _Step:
    def __init__(self):
        self.writes: dict[str, tuple] = {}  # key -> (rows, values)
        self.units: dict[str, tuple] = {}  # head or neuron key -> (rows, units, values)
        self.noise = None  # (rows, values) added to the embedding
        self.start = None  # (rows, values): the stream entering the start layer
        self.captures: dict[str, list] = {}  # key -> [(row0, row1, buffer, pos0)]
        # the rows whose logits are read, in order: [(request, first position, number of rows)]. A
        # request's last row comes from vLLM's own logits (one row per request, in batch order:
        # `vllm_rows`); the rows before it are unembedded by the final norm's hook (`own_rows`, batch
        # rows of the hidden states). `*_dest`: where each lands among the read rows.
        self.reads: list[tuple[_Request, int, int]] = []
        self.own_rows = self.own_dest = self.vllm_rows = self.vllm_dest = None
        self.own_logits = None
        self.done: list[_Request] = []  # requests whose last position is in this step

    def to(self, device) -> None:
        """One transfer per tensor per step, to where the activations are."""
        self.writes = {k: tuple(t.to(device) for t in v) for k, v in self.writes.items()}
        self.units = {k: tuple(t.to(device) for t in v) for k, v in self.units.items()}
        if self.noise is not None:
            self.noise = tuple(t.to(device) for t in self.noise)
        if self.start is not None:
            self.start = tuple(t.to(device) for t in self.start)
        for name in ("own_rows", "own_dest", "vllm_rows", "vllm_dest"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).to(device))


def _unbatched(hook, batched: bool):
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


class _Wrapped:
    """A module's `forward` with a pre-hook run first (marks it as patchgrid's)."""

    def __init__(self, module, forward, hook):
        self.module, self.forward, self.hook = module, forward, hook

    def __call__(self, *args, **kwargs):
        new = self.hook(self.module, args)
        return self.forward(*(args if new is None else new), **kwargs)


class _ForwardHook:
    """A pre-hook on whatever calls the module: its `forward` attribute is replaced on this instance
    (module hooks fire only for calls through the module itself). `remove` puts back what was there:
    nothing (the class's forward), or a forward of the instance's own (vLLM rebinds some)."""

    def __init__(self, module, hook):
        self.module = module
        self.own = module.__dict__.get("forward")
        module.forward = _Wrapped(module, module.forward, hook)

    def remove(self):
        if self.own is None:
            del self.module.forward
        else:
            self.module.forward = self.own


class _Skipped(torch.nn.Module):
    """Stands in for a layer below the start in a decoder that loops over every layer (transformers'
    own, in vLLM's Transformers backend): hands the stream on without computing anything, and the
    start layer's pre-hook then replaces it with the cached stream."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


_SKIPPED = _Skipped()


def _start_by(family: Family, decoder, layers) -> str | None:
    """How a forward of this model starts mid-stack: "start_layer" (vLLM's decoders loop over
    layers[start_layer:], its pipeline-parallel split), "stand_ins" (transformers' decoder in vLLM's
    Transformers backend loops over every layer: the ones below are swapped for `_Skipped`), or None."""
    if family.stream_arg is None:
        return None
    if getattr(decoder, "start_layer", None) == 0:
        return "start_layer"
    if family.vllm_transformers and isinstance(layers, torch.nn.ModuleList):
        return "stand_ins"
    return None


def put(t: torch.Tensor, index, values: torch.Tensor, what: str) -> None:
    """t[index] = values, refusing values or indices that live elsewhere than t (on a GPU an index
    write from the CPU fails or copies per hook)."""
    _same_device(t, index, values, what)
    t[index] = values


def _same_device(t, index, values, what):
    for x in (index if isinstance(index, tuple) else (index,)) + (values,):
        if x.device != t.device:
            raise RuntimeError(f"patchgrid worker: {what} writes a tensor on {x.device} into activations on "
                               f"{t.device}")


class _Session:
    def __init__(self, runner, sources, keys, family: Family, shape: dict, start_layer: int = 0):
        self.runner = runner
        self.model = runner.get_model()
        self.family = family
        self.vocab = shape["vocab_size"]
        param = next(self.model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.sources = {name: {k: decode_tensor(v).to(self.dtype) for k, v in caps.items() if k != LOGPROBS}
                        for name, caps in sources.items()}
        # reference log-probabilities stay float32, on the activations' device (read every step)
        self.references = {name: decode_tensor(caps[LOGPROBS]).float().to(self.device)
                           for name, caps in sources.items() if LOGPROBS in caps}
        self.tp = _tp_rank_and_size()
        tp_size = self.tp[1]
        # this rank's width of each site: z is split over tensor-parallel ranks by heads, the MLP's
        # hidden layer by neurons
        n_kv = shape.get("n_kv_heads") or shape["n_heads"]
        z = units_per_rank(shape["n_heads"], tp_size) * shape["head_dim"]
        kv = units_per_rank(n_kv, tp_size, "key/value heads") * shape["head_dim"] if n_kv % tp_size == 0 else 0
        local = {"z": z, "q": z, "kv": kv, "mlp": units_per_rank(shape["d_mlp"], tp_size, "MLP neurons"),
                 "d_model": shape["d_model"], "pattern": 0}
        self.widths = {name: local[site.width] for name, site in SITES.items()}
        self.widths.update(d_model=shape["d_model"],
                           units={"head": shape["n_heads"], "kv_head": n_kv, "neuron": shape["d_mlp"]},
                           unit_width={"head": shape["head_dim"], "kv_head": shape["head_dim"], "neuron": 1})
        self.requests: dict[str, _Request | None] = {}
        self.results: dict[str, list] = {}
        self.step = _Step()
        self._own_call = False
        self.handles = []
        self.start_layer = start_layer
        self._decoder = None
        self._skipped = None  # (layers, the layers below the start) while stand-ins run in their place
        # Gemma's decoder multiplies the embedding module's output by sqrt(d_model) (its `normalizer`)
        # after the module: the embed site is the product, as transformers' module returns it
        self.embed_scale = get_module(self.model, family.decoder).normalizer if family.embed_scaled else None
        try:
            self._install(set(keys))
            if start_layer:
                self._start_at(start_layer)
        except BaseException:
            self.remove()
            raise

    def _start_at(self, layer: int):
        decoder = get_module(self.model, self.family.decoder)
        layers = get_module(self.model, self.family.layers)
        how = _start_by(self.family, decoder, layers)
        if how is None:
            raise RuntimeError(f"patchgrid worker: the {self.family.name} decoder cannot start at layer {layer} here")
        # first among the layer's pre-hooks: a patch or capture of the stream entering it (resid_pre)
        # sees the cached stream
        self.handles.append(layers[layer].register_forward_pre_hook(
            _unbatched(self._on_start, self.family.vllm_transformers), prepend=True))
        if how == "start_layer":
            self._decoder = decoder
            decoder.start_layer = layer
        else:  # put back in remove(), however the call ends
            self._skipped = (layers, [layers[i] for i in range(layer)])
            for i in range(layer):
                layers[i] = _SKIPPED

    # ---- hooks ----
    def _pre(self, module, hook):
        self.handles.append(module.register_forward_pre_hook(_unbatched(hook, self.family.vllm_transformers)))

    def _post(self, module, hook):
        self.handles.append(module.register_forward_hook(_unbatched(hook, self.family.vllm_transformers)))

    def _install(self, keys):
        m, fam = self.model, self.family
        embed = get_module(m, fam.embed)
        # The embedding is the first module every forward calls (the decoder module itself is
        # wrapped by vLLM's compile decorator, which bypasses module hooks).
        self._pre(embed, self._begin_step)
        self._post(embed, self._on_embed)
        # The final norm's output is what the unembedding reads: its rows at the last prompt position
        # and over the continuations are unembedded here (vLLM itself unembeds each request's last row only).
        self._post(get_module(m, fam.final_norm), self._on_final)
        # vLLM's own module, called with [tokens, d] in every family
        self.handles.append(m.logits_processor.register_forward_hook(self._on_logits))
        attention = set()  # layers whose q, k or v are read or written
        for key in keys - {"embed"}:  # the embedding's hooks above handle embed
            site, layer = parse_key(key)
            module = site_module(m, fam, site, layer)
            if SITES[site].at == "attention":
                attention.add(layer)
            elif SITES[site].at == "input" and SITES[site].unit is None:
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
        for layer in attention:
            kernel = get_module(site_module(m, fam, "q", layer), fam.attn_kernel)
            # Its input is [tokens, heads * head_dim] in every family; vLLM's Transformers backend
            # calls its `forward` directly, so the hook runs from there, not as a module hook.
            self.handles.append(_ForwardHook(kernel, self._make_attention_hook(layer)))

    def remove(self):
        if self._decoder is not None:
            self._decoder.start_layer = 0
            self._decoder = None
        if self._skipped is not None:
            layers, originals = self._skipped
            for i, module in enumerate(originals):
                layers[i] = module
            self._skipped = None
        for h in self.handles:
            h.remove()
        self.handles = []

    def _begin_step(self, module, args):
        runner = self.runner
        batch = runner.input_batch
        n = batch.num_reqs
        step = _Step()
        self.step = step
        if n == 0:  # profiling and dummy runs
            return
        qsl = runner.query_start_loc.np
        writes, units, noise, caps, start = {}, {}, [], {}, []
        own_rows, own_dest, vllm_rows, vllm_dest = [], [], [], []
        n_read = 0
        for i in range(n):
            rid = batch.req_ids[i]
            r = self.requests.get(rid, False)
            if r is False:
                r = self._new_request(rid)
            if r is None:
                continue
            row0, row1 = int(qsl[i]), int(qsl[i + 1])
            pos0 = int(batch.num_computed_tokens_cpu[i])
            pos1 = pos0 + (row1 - row0)
            if self.start_layer:
                start.append((torch.arange(row0, row1), r.stream[pos0:pos1]))
            for key, unit, pos, vals in r.patches:
                sel = (pos >= pos0) & (pos < pos1)
                if not sel.any():
                    continue
                rows = torch.from_numpy(pos[sel] - pos0 + row0)
                v = vals[torch.from_numpy(sel)]
                if unit is None:
                    writes.setdefault(key, []).append((rows, v))
                else:
                    units.setdefault(key, []).append((rows, torch.full_like(rows, unit), v))
            for pos, vals in r.noise:
                sel = (pos >= pos0) & (pos < pos1)
                if sel.any():
                    noise.append((torch.from_numpy(pos[sel] - pos0 + row0), vals[torch.from_numpy(sel)]))
            for key, buf in r.captures.items():
                caps.setdefault(key, []).append((row0, row1, buf, pos0))
            # positions n_prompt - 1 .. n_tokens - 1 are read: the last prompt position, and the
            # positions predicting each continuation's tokens
            lo = max(pos0, r.n_prompt - 1)
            if lo < pos1:
                step.reads.append((r, lo, pos1 - lo))
                done = pos1 >= r.n_tokens
                own = (pos1 - 1 if done else pos1) - lo  # vLLM unembeds the request's last row itself
                if own:
                    own_rows.append(torch.arange(lo - pos0 + row0, lo - pos0 + row0 + own))
                    own_dest.append(torch.arange(n_read, n_read + own))
                if done:
                    vllm_rows.append(i)
                    vllm_dest.append(n_read + own)
                n_read += pos1 - lo
            if pos1 >= r.n_tokens:
                step.done.append(r)
        step.writes = {k: (torch.cat([a for a, _ in v]), torch.cat([b for _, b in v])) for k, v in writes.items()}
        step.units = {k: tuple(torch.cat([t[j] for t in v]) for j in range(3)) for k, v in units.items()}
        if noise:
            step.noise = (torch.cat([a for a, _ in noise]), torch.cat([b for _, b in noise]))
        if start:
            step.start = (torch.cat([a for a, _ in start]), torch.cat([b for _, b in start]))
        step.captures = caps
        if own_rows:
            step.own_rows, step.own_dest = torch.cat(own_rows), torch.cat(own_dest)
        if vllm_rows:
            step.vllm_rows, step.vllm_dest = torch.tensor(vllm_rows), torch.tensor(vllm_dest)
        step.to(self.device)

    def _new_request(self, rid):
        state = self.runner.requests.get(rid)
        extra = getattr(getattr(state, "sampling_params", None), "extra_args", None) or {}
        plan = extra.get(PLAN_KEY)
        r = None if plan is None else _Request(plan, len(state.prompt_token_ids), self.sources, self.references,
                                               self.widths, self.dtype, self.tp)
        if self.start_layer and (r is None or r.start is None or r.start.layer != self.start_layer):
            # every row of a call that starts mid-stack needs its stream; the engine groups calls so
            raise RuntimeError(f"patchgrid worker: request {rid} does not start at layer {self.start_layer}, "
                               "as every request of this call must")
        self.requests[rid] = r
        return r

    def _on_start(self, module, args):
        """Layer `start_layer`'s input becomes the cached stream (the layers below did not run)."""
        step = self.step
        if step.start is None:  # profiling and dummy runs
            return None
        i = self.family.stream_arg
        stream = args[i].clone()
        put(stream, *step.start, "the start stream")
        key = stream_key(self.start_layer)
        w = step.writes.get(key)
        if w is not None:
            put(stream, w[0], w[1], key)
        self._capture(key, lambda a, b: stream[a:b])
        return args[:i] + (stream,) + args[i + 1:]

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
            put(out, rows, out[rows] + (vals if scale is None else vals / scale), "noise")
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
        rotary embedding): a patch writes one head's columns of a copy."""
        keys = [site_key(site, layer) for site in QKV]
        hd = self.widths["unit_width"]["head"]

        def hook(module, args):
            out = list(args[:3])
            for i, key in enumerate(keys):
                w = self.step.units.get(key)
                if w is not None:
                    rows, units, vals = w
                    out[i] = out[i].clone()
                    put(out[i].view(out[i].shape[0], -1, hd), (rows, units), vals, key)
                self._capture(key, lambda a, b, t=out[i]: t[a:b])
            if all(a is b for a, b in zip(out, args)):
                return None
            return tuple(out) + tuple(args[3:])

        return hook

    def _make_input_hook(self, key):
        """z (o_proj's input) or the neurons (the down projection's input): a patch writes one
        head's slice of it, or one neuron's column."""
        site = parse_key(key)[0]
        uw = self.widths["unit_width"][SITES[site].unit]

        def hook(module, args):
            z = args[0]
            w = self.step.units.get(key)
            if w is not None:
                rows, units, vals = w
                put(z.view(z.shape[0], -1, uw), (rows, units), vals, key)
            self._capture(key, lambda a, b: z[a:b])
            return None

        return hook

    def _on_final(self, module, args, out):
        """Unembed the read rows vLLM will not: every one but each finishing request's last."""
        step = self.step
        if step.own_rows is None:
            return None
        hidden = out[0] if isinstance(out, tuple) else out
        self._own_call = True  # the logits hook below ignores this call
        try:
            step.own_logits = self.model.compute_logits(hidden[step.own_rows])
        finally:
            self._own_call = False
        return None

    def _on_logits(self, module, args, out):
        """vLLM's logits (one row per request of the step) beside the final norm's rows: every read
        row's readings, and the results of the requests that finish in this step."""
        step = self.step
        if self._own_call or not step.reads:
            return None
        if out is not None:  # None on tensor-parallel ranks but the first: logits live on rank 0
            n_read = sum(count for _, _, count in step.reads)
            logits = torch.empty(n_read, self.vocab, dtype=torch.float32, device=out.device)
            if step.vllm_rows is not None:
                logits[step.vllm_dest] = out[step.vllm_rows, : self.vocab].float()
            if step.own_logits is not None:
                logits[step.own_dest] = step.own_logits[:, : self.vocab].float()
            self._read(step, logits)
        for r in step.done:
            self.results[r.tag] = r.part()
        return None

    def _read(self, step: _Step, logits: torch.Tensor) -> None:
        """Every read row's log-probabilities of the tokens it predicts; at the last prompt position
        of a request's first forward, the answers' logits and ranks, top_k, the KL divergence from
        its reference and its own log-probabilities. Batched over the step's rows."""
        lse = torch.logsumexp(logits, dim=1)
        firsts, targets = [], []  # (row, request) | (row, token, request, continuation, k)
        row = 0
        for r, lo, count in step.reads:
            for pos in range(lo, lo + count):
                if pos == r.n_prompt - 1 and r.first:
                    firsts.append((row, r))
                k = pos - (r.n_prompt - 1)
                for j, tokens in r.scores:
                    if k < len(tokens):
                        targets.append((row, tokens[k], r, j, k))
                row += 1
        if targets:
            rows = torch.tensor([t[0] for t in targets], device=logits.device)
            toks = torch.tensor([t[1] for t in targets], device=logits.device)
            values = (logits[rows, toks] - lse[rows]).tolist()
            for (_, _, r, j, k), v in zip(targets, values):
                r.scored[j][k] = v
        if not firsts:
            return
        rows = torch.tensor([f[0] for f in firsts], device=logits.device)
        first_logits, first_lse = logits[rows], lse[rows]
        kls = [None] * len(firsts)
        with_ref = [k for k, (_, r) in enumerate(firsts) if r.reference is not None]
        if with_ref:
            refs = torch.stack([firsts[k][1].reference for k in with_ref])
            sel = torch.tensor(with_ref, device=logits.device)
            lp = first_logits[sel] - first_lse[sel, None]
            for k, v in zip(with_ref, kl_divergence(refs, lp).tolist()):
                kls[k] = v
        lse_list = first_lse.tolist()
        # the answers' logits and ranks, one batched read per number of answers
        by_count = defaultdict(list)
        for k, (_, r) in enumerate(firsts):
            by_count[len(r.answers)].append(k)
        answers = {}
        for count, ks in by_count.items():
            if not count:
                continue
            sel = torch.tensor(ks, device=logits.device)
            tokens = torch.tensor([firsts[k][1].answers for k in ks], device=logits.device)
            vals = first_logits[sel].gather(1, tokens).tolist()
            ranks = answer_ranks(first_logits[sel], tokens).tolist()
            answers.update(zip(ks, zip(vals, ranks)))
        for k, (_, r) in enumerate(firsts):
            vals, ranks = answers.get(k, ([], []))
            out = {"answer_logits": vals, "answer_ranks": ranks, "logsumexp": lse_list[k], "top_ids": [],
                   "top_logits": [], "kl": kls[k], "logprobs": None}
            if r.top_k:
                top, ids = torch.topk(first_logits[k], min(r.top_k, first_logits.shape[1]))
                out["top_ids"], out["top_logits"] = ids.tolist(), top.tolist()
            if r.logprobs:
                out["logprobs"] = encode_tensor(first_logits[k] - first_lse[k])
            r.readout = out


def _tp_rank_and_size() -> tuple[int, int]:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except Exception:  # no parallel state: a single rank
        return 0, 1


class PatchgridWorker:
    """Mixed into vLLM's worker class via LLM(worker_extension_cls=...)."""

    def pg_begin(self, sources: dict, keys: list, family: str, shape: dict, start_layer: int = 0) -> bool:
        old = getattr(self, "_pg_session", None)
        if old is not None:
            old.remove()
            self._pg_session = None
        runner = self.model_runner
        if not hasattr(runner, "input_batch"):
            raise RuntimeError(f"patchgrid worker: {type(runner).__name__} is not vLLM's V1 model runner, whose "
                               "batch layout the worker reads; set VLLM_USE_V2_MODEL_RUNNER=0")
        self._pg_session = _Session(runner, sources, keys, FAMILIES[family].in_vllm(), shape, start_layer)
        return True

    def pg_can_start_midstack(self, family: str) -> bool:
        """Whether a call can start at a later layer: this model's decoder loops over
        layers[start_layer:] (vLLM's pipeline-parallel split) from layer 0, or its layers can be
        swapped for stand-ins (`_start_by`)."""
        fam = FAMILIES[family].in_vllm()
        model = self.model_runner.get_model()
        try:
            decoder, layers = get_module(model, fam.decoder), get_module(model, fam.layers)
        except (AttributeError, IndexError):
            return False
        return _start_by(fam, decoder, layers) is not None

    def pg_end(self) -> dict:
        session = getattr(self, "_pg_session", None)
        if session is None:
            return {}
        session.remove()
        self._pg_session = None
        return session.results

    def pg_start_layer(self, family: str) -> int:
        """The layer the model's forwards start at now (0 between calls)."""
        fam = FAMILIES[family].in_vllm()
        model = self.model_runner.get_model()
        decoder = get_module(model, fam.decoder)
        if hasattr(decoder, "start_layer"):
            return decoder.start_layer
        layers = get_module(model, fam.layers)
        return next((i for i, m in enumerate(layers) if not isinstance(m, _Skipped)), len(layers))

    def pg_model_class(self) -> str:
        """The class vLLM runs the model as (its own model, or TransformersForCausalLM)."""
        return type(self.model_runner.get_model()).__name__

    def pg_hook_count(self) -> int:
        """Forward hooks left on the model, for tests that check nothing leaks between calls."""
        model = self.model_runner.get_model()
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + isinstance(m.__dict__.get("forward"), _Wrapped)
                   for m in model.modules())
