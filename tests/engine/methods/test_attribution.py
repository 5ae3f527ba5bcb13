"""Attribution patching: the gradient estimate against finite differences of the same
linearisation, against exact patches where the metric is linear in the site, and the atp sweep's
verification against direct patches on vLLM."""
from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from patchgrid.cache import load_or_build
from patchgrid.methods.attribution import Attributor
from patchgrid.model.sites import get_module, site_module
from patchgrid.sweeps import SweepConfig, cache_spec, count_runs, run_sweeps
from tests.support.engines import TINY, needs_vllm
from tests.support.pairs import shipped_pairs
from tests.unit.methods.test_attribution import _model64

SITES = ("resid", "attn_out", "mlp_out", "head", "neuron")


def _pairs(tokenizers, model):
    pairs = shipped_pairs(tokenizers(model), 3)
    # answers of several tokens: the metric sums every forward's log-probabilities
    a, b = pairs[0].clean_answer_id, pairs[0].corrupt_answer_id
    pairs[0] = replace(pairs[0], clean_answer_ids=(a, 11, 12), corrupt_answer_ids=(b, 13))
    return pairs


def _metric(model, pair, patch=None) -> float:
    """log p(clean answer) - log p(corrupt answer), each whole, on the corrupt prompt, by plain
    transformers forwards; `patch` = (module, is_input, fn) rewrites a site's activation."""
    handle = None
    if patch is not None:
        module, is_input, fn = patch
        if is_input:
            handle = module.register_forward_pre_hook(lambda mod, args: (fn(args[0]),) + args[1:])
        else:
            def out_hook(mod, args, out):
                if isinstance(out, tuple):
                    return (fn(out[0]),) + out[1:]
                return fn(out)
            handle = module.register_forward_hook(out_hook)
    total = 0.0
    try:
        with torch.no_grad():
            n = len(pair.corrupt_ids)
            for sign, answer in ((1, pair.clean_answer_ids), (-1, pair.corrupt_answer_ids)):
                ids = torch.tensor([list(pair.corrupt_ids) + list(answer[:-1])])
                lp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
                total += sign * sum(float(lp[n - 1 + k, t]) for k, t in enumerate(answer))
    finally:
        if handle is not None:
            handle.remove()
    return total


def _acts(model, shape, ids, site, layer):
    from patchgrid.model.sites import SITES as S

    got = {}
    module = site_module(model, shape.family, site, layer)

    def read(t):
        got["a"] = t.clone()  # returns None: the hook leaves the activation as it is

    if S[site].at == "input":
        h = module.register_forward_pre_hook(lambda mod, args: read(args[0]))
    else:
        h = module.register_forward_hook(lambda mod, args, out: read(out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([list(ids)]))
    finally:
        h.remove()
    return got["a"][0]


def _writer(shape, site, position, unit, value):
    """fn(t) writing `value` [width] into t at one position (or every one: position None), over one
    unit's columns when `unit` is set."""
    def fn(t):
        t = t.clone()
        pos = slice(0, len(value)) if position is None else position  # the prompt's positions
        if unit is None:
            t[0, pos] = value[pos]
        else:
            uw = shape.unit_width(site)
            t[0, pos, unit * uw:(unit + 1) * uw] = value[pos, unit * uw:(unit + 1) * uw]
        return t
    return fn


@pytest.mark.parametrize("model", TINY)
def test_estimate_equals_finite_differences_of_the_linearisation(tokenizers, model):
    m, shape = _model64(model)
    att = Attributor(m, shape)
    pairs = _pairs(tokenizers, model)
    est = att.estimate(pairs, SITES)
    from patchgrid.model.sites import SITES as S

    for b, pair in enumerate(pairs[:2]):
        n = len(pair.corrupt_ids)
        for site in SITES:
            for layer, position, unit in ((1, n - 1, 1), (shape.n_layers - 1, pair.subject_end - 1, 2),
                                          (0, None, 0)):
                clean = _acts(m, shape, pair.clean_ids, site, layer)
                corrupt = _acts(m, shape, pair.corrupt_ids, site, layer)
                u = unit if S[site].unit else None
                module = site_module(m, shape.family, site, layer)
                # the norms compute in float32 even in a float64 model: a step small enough to keep
                # the curvature out and large enough to stay above their rounding
                eps = 2e-3
                vals = [_metric(m, pair, (module, S[site].at == "input",
                                          _writer(shape, site, position, u, corrupt + s * eps * (clean - corrupt))))
                        for s in (1, -1)]
                fd = (vals[0] - vals[1]) / (2 * eps)
                got = float(est[b][site]["estimate"][layer, n if position is None else position, unit if u is not None
                                                     else 0])
                assert got == pytest.approx(fd, abs=2e-4, rel=1e-3), (pair.pair_id, site, layer, position, unit)
    # the estimate moves: a check of zeros would prove nothing
    assert max(float(e["resid"]["estimate"].abs().max()) for e in est) > 0.1


def test_estimate_equals_the_exact_patch_where_the_metric_is_linear_in_the_site(tokenizers):
    """Without the final norm, the last layer's stream, its MLP output and its neurons reach the
    logits only linearly (the unembedding), so AtP is exact there; a one-token answer keeps the log
    normaliser out (the metric is a logit difference)."""
    m, shape = _model64("tiny-llama")
    m.model.norm = torch.nn.Identity()
    att = Attributor(m, shape)
    pairs = shipped_pairs(tokenizers("tiny-llama"), 2)
    est = att.estimate(pairs, ("resid", "mlp_out", "neuron"))
    last = shape.n_layers - 1
    checked = 0
    for b, pair in enumerate(pairs):
        n = len(pair.corrupt_ids)
        base = _metric(m, pair)
        for site, unit in (("resid", None), ("mlp_out", None), ("neuron", 3), ("neuron", 200)):
            clean = _acts(m, shape, pair.clean_ids, site, last)
            module = site_module(m, shape.family, site, last)
            for position in (n - 1, None):
                exact = _metric(m, pair, (module, site == "neuron", _writer(shape, site, position, unit, clean))) - base
                got = float(est[b][site]["estimate"][last, n if position is None else position, unit or 0])
                assert got == pytest.approx(exact, abs=1e-9, rel=1e-9), (site, unit, position)
                checked += abs(exact) > 1e-3
    assert checked >= 4


def _estimate_with_layer_cut(m, shape, pair, site, drop):
    """AtP of `site` at every layer and position, [layers, n + 1], by plain autograd with layer
    `drop`'s residual-stream contribution (its attention's and MLP's outputs) detached (None: none)."""
    from patchgrid.model.sites import SITES as S

    n = len(pair.corrupt_ids)
    clean = [_acts(m, shape, pair.clean_ids, site, layer) for layer in range(shape.n_layers)]
    acts, hooks = {}, []
    for layer in range(shape.n_layers):
        module = site_module(m, shape.family, site, layer)
        if S[site].at == "input":
            hooks.append(module.register_forward_pre_hook(lambda mod, args, layer=layer: acts.__setitem__(layer,
                                                                                                      args[0])))
        else:
            hooks.append(module.register_forward_hook(lambda mod, args, out, layer=layer: acts.__setitem__(
                layer, out[0] if isinstance(out, tuple) else out)))
    if drop is not None:  # after the sites' hooks: a site at that output is read before the cut
        for where in ("attn_out", "mlp_out"):
            hooks.append(site_module(m, shape.family, where, drop).register_forward_hook(
                lambda mod, args, out: (out[0].detach(),) + tuple(out[1:]) if isinstance(out, tuple) else out.detach()))
    hooks.append(get_module(m, shape.family.embed).register_forward_hook(lambda mod, args, out: out.requires_grad_()))
    try:
        with torch.enable_grad():
            lp = torch.log_softmax(m(input_ids=torch.tensor([list(pair.corrupt_ids)])).logits[0, -1].double(), -1)
            metric = lp[pair.clean_answer_ids[0]] - lp[pair.corrupt_answer_ids[0]]
            grads = torch.autograd.grad(metric, [acts[layer] for layer in range(shape.n_layers)], allow_unused=True)
    finally:
        for h in hooks:
            h.remove()
    out = torch.zeros(shape.n_layers, n + 1, dtype=torch.float64)
    for layer, g in enumerate(grads):
        if g is not None:
            per = ((clean[layer] - acts[layer][0].detach()) * g[0]).sum(-1)
            out[layer, :n], out[layer, n] = per, per.sum()
    return out


@pytest.mark.parametrize("model", ["tiny-gpt2", "tiny-gemma2"])
def test_graddrop_scores_are_the_mean_absolute_estimate_with_each_layers_backward_cut(tokenizers, model):
    """AtP*'s GradDrop (Kramar et al. 2024, eq. 11): (1 / (L - 1)) sum_l |AtP + GD_l|, GD_l zeroing the
    gradient through layer l's residual-stream contribution (what its attention and MLP add), here
    by detaching those outputs in a plain autograd pass; one-token answers."""
    m, shape = _model64(model)
    att = Attributor(m, shape)
    pair = shipped_pairs(tokenizers(model), 1)[0]
    L = shape.n_layers
    for site in ("resid", "attn_out", "mlp_out"):
        plain = att.estimate([pair], (site,))[0][site]["estimate"][..., 0]
        got = att.estimate([pair], (site,), correction="graddrop")[0][site]
        assert torch.equal(got["estimate"][..., 0], plain)  # the plain one is always there
        assert torch.allclose(_estimate_with_layer_cut(m, shape, pair, site, None), plain, atol=1e-9)
        cut = [_estimate_with_layer_cut(m, shape, pair, site, drop) for drop in range(L)]
        want = sum(c.abs() for c in cut) / (L - 1)
        assert torch.allclose(got["graddrop"][..., 0], want, atol=1e-9), site
        if site != "resid":  # a node inside layer l: its own layer's term is zero
            for layer in range(L):
                assert torch.count_nonzero(cut[layer][layer]) == 0
    assert not torch.allclose(got["graddrop"][0], plain[0].abs())


@needs_vllm
@pytest.mark.parametrize("correction", ["none", "graddrop"])
def test_atp_sweep_verifies_the_strongest_and_a_sample_exactly(tmp_path, engines, tokenizers, correction):
    model = "tiny-qwen3"
    vl = engines.get(model, "vllm", dtype="float32")
    pairs = _pairs(tokenizers, model)
    kinds = ("resid", "attn_out", "mlp_out", "heads", "neurons")
    config = SweepConfig(sweeps=("atp",), atp_kinds=kinds, verify_top=5, verify_random=4, atp_correction=correction,
                         seed=3)
    exact_config = SweepConfig(sweeps=kinds, resid_directions=("denoise",))
    spec = cache_spec(config, vl.shape.n_layers).merge(cache_spec(exact_config, vl.shape.n_layers))
    cache, _ = load_or_build(vl, pairs, spec, tmp_path, log=lambda *_: None)
    rows = run_sweeps(vl, pairs, cache, config)
    # the exhaustive exact sweep of the same cells, on the same engine
    exact = {_cell(r): r for r in run_sweeps(vl, pairs, cache, exact_config)}
    ctx_cells = {_cell(r) for r in rows}
    assert ctx_cells == set(exact), "atp rows cover exactly the cells of the kinds it screens"
    assert len(rows) == len(exact)
    verified = [r for r in rows if r["verify"] is not None]
    assert len(verified) == count_runs(pairs, config, vl.shape.n_layers, vl.shape.n_heads, vl.shape.d_mlp)
    for r in rows:
        assert r["sweep"] == "atp" and r["estimate"] is not None
        assert (r["estimate_graddrop"] is not None) == (correction == "graddrop")
        if r["verify"] is None:
            assert r["effect"] is None and r["patched_logprob_diff"] is None
        else:  # patched exactly: the direct patch of the same site
            e = exact[_cell(r)]
            assert r["effect"] == pytest.approx(e["effect"], abs=1e-5)
            assert r["patched_kl"] == pytest.approx(e["patched_kl"], abs=1e-5)
            assert r["metric"] == "logprob_diff"  # the AtP objective, for every pair
    for pair in pairs:
        for site, every in itertools.product(("resid", "attn_out", "mlp_out", "head", "neuron"), (True, False)):
            mine = [r for r in rows if r["pair_id"] == pair.pair_id and r["site"] == site
                    and (r["position"] is None) == every]  # each scope its own top K and sample
            if not mine:
                continue
            top = [r for r in mine if r["verify"] == "top"]
            score = (lambda r: r["estimate_graddrop"]) if correction == "graddrop" else (lambda r: abs(r["estimate"]))
            assert len(top) == 5 and len([r for r in mine if r["verify"] == "random"]) == 4
            assert min(score(r) for r in top) >= max(score(r) for r in mine if r["verify"] != "top")
    # the sample is seeded: the same again
    again = run_sweeps(vl, pairs, cache, config)
    assert [(_cell(r), r["verify"]) for r in again] == [(_cell(r), r["verify"]) for r in rows]
    # where AtP is roughly right on this model: estimate and exact effect correlate over the verified
    xs = torch.tensor([r["estimate"] for r in verified])
    ys = torch.tensor([r["effect"] for r in verified])
    assert torch.corrcoef(torch.stack([xs, ys]))[0, 1] > 0.5


def _cell(r):
    return (r["pair_id"], r["site"], r["layer"], r["position"], r["head"], r["neuron"])


def test_the_atp_sweep_takes_its_gradients_where_and_in_the_dtype_asked(tmp_path, engines, tokenizers):
    """run_sweeps' attributor as options (a shard's `attribution`): the gradient model is made once per
    engine and options, in that dtype; bfloat16 estimates are float32's within half precision."""
    from patchgrid.methods.attribution import attributor_for

    model = "tiny-llama"
    hf = engines.get(model, "hf", dtype="float32")
    pairs = _pairs(tokenizers, model)
    config = SweepConfig(sweeps=("atp",), atp_kinds=("resid",), verify_top=1, verify_random=0)
    cache, _ = load_or_build(hf, pairs, cache_spec(config, hf.shape.n_layers), tmp_path, log=lambda *_: None)
    full = run_sweeps(hf, pairs, cache, config, attributor={"device": "cpu", "dtype": "float32"})
    half = run_sweeps(hf, pairs, cache, config, attributor={"device": "cpu", "dtype": "bfloat16"})
    made = attributor_for(hf, device="cpu", dtype="bfloat16")
    assert next(made.model.parameters()).dtype == torch.bfloat16 and made.device.type == "cpu"
    assert made is attributor_for(hf, device="cpu", dtype="bfloat16")
    assert made is not attributor_for(hf, device="cpu")  # float32, the default: made once, by the first sweep
    xs = torch.tensor([r["estimate"] for r in full])
    ys = torch.tensor([r["estimate"] for r in half])
    assert not torch.equal(xs, ys) and torch.allclose(xs, ys, atol=0.05 * float(xs.abs().max()))

