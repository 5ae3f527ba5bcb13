from __future__ import annotations

import dataclasses

import torch

from patchgrid.model.sites import site_key
from patchgrid.plan import Knockout, Noise, Patch, Request, Start, latest_start

TOL = 1e-4


def all_keys(shape, pattern: bool = True):
    """Every readable site the family has (Family.missing), at every layer; the attention pattern too
    unless `pattern` is false (it is read on one rank only)."""
    sites = ("resid_pre", "resid_mid", "resid", "attn_out", "mlp_out", "q", "k", "v", "head", "neuron") + (
        ("pattern",) if pattern else ())
    return ["embed"] + [site_key(s, layer) for s in sites if not shape.family.missing(s)
                        for layer in range(shape.n_layers)]


def every_site_requests(shape, corrupt, answers, source="clean", layers=None, attention=True):
    """One request per (site, layer[, head]) patch at a couple of positions, plus noise and all-position
    patches; `layers`: only those layers' (default: every layer); with `attention`, pattern patches
    (the source holds the patterns) and knockouts besides (attention_requests)."""
    n = len(corrupt)
    pos = (1, n - 1)
    reqs = [Request(tokens=corrupt, answers=answers, top_k=5)]
    reqs.append(Request(tokens=corrupt, answers=answers, patches=(Patch("embed", None, source, pos),)))
    for layer in range(shape.n_layers) if layers is None else layers:
        for site in ("resid_pre", "resid_mid", "resid", "attn_out", "mlp_out"):
            reqs.append(Request(tokens=corrupt, answers=answers, patches=(Patch(site, layer, source, pos),)))
            reqs.append(Request(tokens=corrupt, answers=answers, patches=(Patch(site, layer, source, None),)))
        for head in range(shape.n_heads):
            reqs.append(Request(tokens=corrupt, answers=answers, patches=(Patch("head", layer, source, pos, head),)))
            reqs.append(Request(tokens=corrupt, answers=answers, patches=(Patch("q", layer, source, pos, head),)))
        for head in range(shape.kv_heads):  # key/value heads
            for site in ("k", "v"):
                reqs.append(Request(tokens=corrupt, answers=answers, patches=(Patch(site, layer, source, pos, head),)))
        reqs.append(Request(tokens=corrupt, answers=answers, patches=(Patch("q", layer, source, None, 1),
                                                                      Patch("k", layer, source, None, 0),
                                                                      Patch("v", layer, source, (n - 1,), 1))))
        # neurons at both ends of each tensor-parallel rank's half, and inside
        for neuron in (0, shape.d_mlp // 2 - 1, shape.d_mlp // 2, shape.d_mlp - 1, 37):
            reqs.append(Request(tokens=corrupt, answers=answers,
                                patches=(Patch("neuron", layer, source, pos, neuron=neuron),)))
        reqs.append(Request(tokens=corrupt, answers=answers, patches=(Patch("neuron", layer, source, None, neuron=5),)))
    # causal-tracing shape: noise on the subject, restore one layer's stream
    reqs.append(Request(tokens=corrupt, answers=answers, noise=(Noise((1, 2), 0.7, 11),)))
    reqs.append(Request(tokens=corrupt, answers=answers, noise=(Noise((1, 2), 0.7, 11),),
                        patches=(Patch("resid", shape.n_layers // 2, source, (2,)),)))
    if attention:
        reqs += attention_requests(shape, corrupt, answers, source, layers)
    # the sites the family has (Family.missing: no resid_mid in a parallel block, no neuron in a mixture)
    return reading_logprobs([r for r in reqs if not any(shape.family.missing(p.site) for p in r.patches)])


def attention_requests(shape, tokens, answers, source="clean", layers=None):
    """Per layer: one head's pattern patched from `source` at two positions, the last head's at every
    position; the last position's attention to positions 1-3 knocked out there, and to itself over
    that layer and the next; and one knockout over every layer of every query past position 3."""
    n, last = len(tokens), len(tokens) - 1
    reqs = []
    for layer in range(shape.n_layers) if layers is None else layers:
        reqs.append(Request(tokens=tokens, answers=answers, patches=(Patch("pattern", layer, source, (1, last), 0),)))
        reqs.append(Request(tokens=tokens, answers=answers,
                            patches=(Patch("pattern", layer, source, None, shape.n_heads - 1),)))
        reqs.append(Request(tokens=tokens, answers=answers, knockout=Knockout((layer,), (last,), (1, 2, 3))))
        window = tuple(range(layer, min(layer + 2, shape.n_layers)))
        reqs.append(Request(tokens=tokens, answers=answers, knockout=Knockout(window, (last,), (last,))))
    reqs.append(Request(tokens=tokens, answers=answers,
                        knockout=Knockout(tuple(range(shape.n_layers)), tuple(range(4, n)), (0, 2))))
    return reqs


def reading_logprobs(reqs):
    """`reqs`, each returning its log-probabilities, which tell an answer rank two correct runs may
    order either way (a near-tie in a tiny model's flat logits) from a wrong one (assert_results_close)."""
    return [dataclasses.replace(r, logprobs=True) for r in reqs]


def assert_results_close(a, b, tol=TOL):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        diff = (x.answer_logits - y.answer_logits).abs().max().item()
        assert diff <= tol, f"request {i}: answer logits differ by {diff}"
        assert (x.logsumexp is None) == (y.logsumexp is None), f"request {i}: one has no logsumexp"
        if x.logsumexp is not None:
            assert abs(x.logsumexp - y.logsumexp) <= tol, f"request {i}: logsumexp differs"
        assert x.top_ids == y.top_ids, f"request {i}: top-k ids differ"
        assert _ranks_agree(x, y, tol), f"request {i}: answer ranks differ ({x.answer_ranks} vs {y.answer_ranks})"
        assert len(x.continuation_logprobs) == len(y.continuation_logprobs)
        for j, (cx, cy) in enumerate(zip(x.continuation_logprobs, y.continuation_logprobs)):
            assert len(cx) == len(cy)
            d = max((abs(u - v) for u, v in zip(cx, cy)), default=0.0)
            assert d <= tol, f"request {i}: continuation {j} log-probabilities differ by {d}"
        assert (x.kl is None) == (y.kl is None)
        if x.kl is not None:
            assert abs(x.kl - y.kl) <= tol, f"request {i}: KL differs by {abs(x.kl - y.kl)}"
        assert (x.logprobs is None) == (y.logprobs is None)
        if x.logprobs is not None:
            d = (x.logprobs - y.logprobs).abs().max().item()
            assert d <= tol, f"request {i}: log-probabilities differ by {d}"
        assert set(x.captures) == set(y.captures)
        for k in x.captures:
            d = (x.captures[k].float() - y.captures[k].float()).abs().max().item()
            assert d <= tol, f"request {i}: capture {k} differs by {d}"


PATTERN_TOL = 1e-5  # attention weights: vLLM's (from the kernel's q and k) against transformers' eager


def assert_patterns_close(a, b, n_heads: int) -> None:
    """Every attention pattern captured in both results equal within PATTERN_TOL; each query row's weights
    on the keys it may read sum to 1 and the keys after it get exactly 0."""
    seen = 0
    for i, (x, y) in enumerate(zip(a, b)):
        for k in (k for k in x.captures if k.startswith("pattern.")):
            d = (x.captures[k] - y.captures[k]).abs().max().item()
            assert d <= PATTERN_TOL, f"request {i}: {k} differs by {d}"
            n = y.captures[k].shape[0]
            w = y.captures[k].view(n, n_heads, n).transpose(0, 1)  # [heads, query, key]
            assert (w.triu(1) == 0).all() and torch.allclose(w.sum(-1), torch.ones(n_heads, n), atol=1e-5), k
            seen += 1
    assert seen, "no pattern was captured"


def _ranks_agree(x, y, tol) -> bool:
    """Equal ranks; or, where `y` returned its log-probabilities (Request.logprobs), ranks a tie
    within `tol` can explain: another token's logit that close to the answer's may fall on either
    side of it in two correct float32 computations, so `x`'s rank must lie between the count of
    tokens above the answer by more than `tol` and the count within `tol` of it or above."""
    if x.answer_ranks == y.answer_ranks:
        return True
    if y.logprobs is None or len(x.answer_ranks) != len(y.answer_ranks):
        return False
    lp = y.logprobs.double()
    for rank, logit in zip(x.answer_ranks, y.answer_logits.double().tolist()):
        own = logit - y.logsumexp
        if not int((lp > own + tol).sum()) <= rank <= int((lp > own - tol).sum()) - 1:
            return False
    return True


def effect_spread(results):
    """How far patches moved the answer: a comparison of unmoved logits would prove nothing."""
    lds = torch.stack([r.answer_logits[0] - r.answer_logits[1] for r in results])
    return float(lds.max() - lds.min())


def starting(reqs, n_layers, stream="corrupt"):
    """Each request started at the latest layer its patches allow, from the cached run `stream`."""
    out = []
    for r in reqs:
        layer = latest_start(r.patches, n_layers, r.knockout)
        out.append(dataclasses.replace(r, start=Start(layer, stream)) if layer else r)
    return out
