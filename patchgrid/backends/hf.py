"""The reference oracle: plain transformers with forward hooks.

Written for obviousness rather than speed: every hook loops over the batch's rows and applies
each request's plan with plain indexing. Requests of equal length share a forward (no padding);
`batch_size=1` gives one forward per request, the loop most tutorials use. It runs on a GPU when
there is one (`device="auto"`); captures and results come back to the CPU.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch

from ..plan import Result, gaussian_noise, resolve_positions, validate
from ..sites import SITES, get_module, parse_key, site_module


class HFEngine:
    name = "hf"

    def __init__(self, model_dir: Path, shape, *, dtype: str = "auto", batch_size: int = 64, device: str = "auto"):
        from transformers import AutoModelForCausalLM

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype, trust_remote_code=False)
        self.model.to(self.device)
        self.model.eval()
        self.shape = shape
        self.folder = Path(model_dir)
        self.batch_size = batch_size
        self.dtype = next(self.model.parameters()).dtype

    def run(self, requests, sources=None) -> list[Result]:
        sources = sources or {}
        requests = list(requests)
        validate(requests, sources, self.shape)
        by_len = defaultdict(list)
        for i, r in enumerate(requests):
            by_len[len(r.tokens)].append(i)
        results: list[Result | None] = [None] * len(requests)
        for idx in by_len.values():
            for k in range(0, len(idx), self.batch_size):
                chunk = idx[k:k + self.batch_size]
                for i, res in zip(chunk, self._forward([requests[i] for i in chunk], sources)):
                    results[i] = res
        return results

    @torch.no_grad()
    def _forward(self, batch, sources) -> list[Result]:
        fam, m, hd = self.shape.family, self.model, self.shape.head_dim
        captures = [dict() for _ in batch]
        # site key -> [(row, positions, value)] and head key -> [(row, positions, head, value)]
        writes, noise = defaultdict(list), []
        for b, r in enumerate(batch):
            n = len(r.tokens)
            for p in r.patches:
                pos = resolve_positions(p.positions, n)
                val = sources[p.source][p.key][pos].to(self.device, self.dtype)
                if p.head is not None:
                    val = val[:, p.head * hd:(p.head + 1) * hd]
                writes[p.key].append((b, pos, p.head, val))
            for z in r.noise:
                noise.append((b, list(z.positions), gaussian_noise(z, self.shape.d_model).to(self.device, self.dtype)))

        def write(key, t):  # t: [batch, tokens, width]
            for b, pos, head, val in writes.get(key, ()):
                if head is None:
                    t[b, pos] = val
                else:
                    t.view(t.shape[0], t.shape[1], -1, hd)[b, pos, head] = val

        def capture(key, t):
            for b, r in enumerate(batch):
                if key in r.capture:
                    captures[b][key] = t[b].detach().to("cpu", copy=True)

        def on_embed(module, args, out):
            write("embed", out)
            for b, pos, val in noise:
                out[b, pos] = out[b, pos] + val
            capture("embed", out)
            return out

        def on_output(key):
            def hook(module, args, out):
                t = out[0] if isinstance(out, tuple) else out
                write(key, t)
                capture(key, t)
            return hook

        def on_input(key):
            def hook(module, args):
                write(key, args[0])
                capture(key, args[0])
            return hook

        keys = set(writes) | {k for r in batch for k in r.capture}
        # the embedding's hook also adds noise, so it is installed whatever the keys
        handles = [get_module(m, fam.embed).register_forward_hook(on_embed)]
        for key in keys - {"embed"}:
            site, layer = parse_key(key)
            module = site_module(m, fam, site, layer)
            if SITES[site].at == "input":
                handles.append(module.register_forward_pre_hook(on_input(key)))
            else:
                handles.append(module.register_forward_hook(on_output(key)))
        try:
            ids = torch.tensor([list(r.tokens) for r in batch], dtype=torch.long, device=self.device)
            logits = m(input_ids=ids, logits_to_keep=1).logits[:, -1, :].float().cpu()
        finally:
            for h in handles:
                h.remove()
        out = []
        for b, r in enumerate(batch):
            lg = logits[b, : self.shape.vocab_size]
            res = Result(answer_logits=lg[list(r.answers)].clone(), logsumexp=float(torch.logsumexp(lg, 0)),
                         captures=captures[b])
            if r.top_k:
                vals, ids_ = torch.topk(lg, min(r.top_k, lg.shape[0]))
                res.top_ids, res.top_logits = ids_.tolist(), vals.tolist()
            out.append(res)
        return out

    def hook_count(self) -> int:
        return sum(len(mod._forward_hooks) + len(mod._forward_pre_hooks) for mod in self.model.modules())

    def close(self):
        self.model = None
