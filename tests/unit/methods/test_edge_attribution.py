"""Edge attribution (patchgrid.methods.edge_attribution) against first-order computations written here from
the papers: an edge's score is the sender's clean - corrupt output times the gradient of the metric
at the receiver's own input, found here by finite differences of the metric with only that
receiver's input moved (the test builds each receiver's projection itself, per family)."""
from __future__ import annotations

import pytest
import torch

from patchgrid.methods.attribution import Attributor
from patchgrid.methods.edge_attribution import EdgeScorer
from patchgrid.methods.graph import INPUT, EdgeGraph, GraphError, check_splittable
from patchgrid.model.sites import FAMILIES, LOGITS, ModelShape, get_module
from tests.engine.methods.test_attribution import _metric, _pairs
from tests.support.engines import TINY
from tests.unit.methods.test_attribution import _model64

# Per family, where the test finds what it rebuilds: the norm before attention, the q, k and v
# projections (module, first column of q, k, v in its output), the norm before the MLP, the MLP, the
# final norm, and the output projection (its weight as [d_model, heads * head_dim] or transposed).
LAYOUT = {
    "llama": dict(norm1="input_layernorm", proj={"q": ("self_attn.q_proj", 0), "k": ("self_attn.k_proj", 0),
                                                 "v": ("self_attn.v_proj", 0)},
                  norm2="post_attention_layernorm", mlp="mlp", final="model.norm", o_proj="self_attn.o_proj",
                  transposed=False),
    "gpt2": dict(norm1="ln_1", proj={"q": ("attn.c_attn", 0), "k": ("attn.c_attn", 1), "v": ("attn.c_attn", 2)},
                 norm2="ln_2", mlp="mlp", final="transformer.ln_f", o_proj="attn.c_proj", transposed=True),
}


def _layers(m, shape):
    return get_module(m, shape.family.layers)


def _capture(m, shape, ids):
    """Per layer its input stream, its z and its MLP output; the final stream; for one prompt."""
    got = {}
    hooks = []
    for layer, block in enumerate(_layers(m, shape)):
        lay = LAYOUT[shape.family.name]
        hooks.append(block.register_forward_pre_hook(
            lambda mod, a, layer=layer: got.__setitem__(("x", layer), a[0][0])))
        hooks.append(get_module(block, lay["o_proj"]).register_forward_pre_hook(
            lambda mod, a, layer=layer: got.__setitem__(("z", layer), a[0][0])))
        hooks.append(get_module(block, lay["mlp"]).register_forward_hook(
            lambda mod, a, out, layer=layer: got.__setitem__(("mlp", layer), out[0])))
    try:
        with torch.no_grad():
            m(input_ids=torch.tensor([list(ids)]))
    finally:
        for h in hooks:
            h.remove()
    return got


def _sender_delta(m, shape, clean, corrupt, sender) -> torch.Tensor:
    """The sender's clean - corrupt output [n, d_model], from the weights."""
    if sender == INPUT:
        return clean[("x", 0)] - corrupt[("x", 0)]
    site, layer, *rest = sender.split(".")
    layer = int(layer)
    if site == "mlp_out":
        return clean[("mlp", layer)] - corrupt[("mlp", layer)]
    h, hd = int(rest[0]), shape.head_dim
    lay = LAYOUT[shape.family.name]
    w = get_module(_layers(m, shape)[layer], lay["o_proj"]).weight
    w = w.T if lay["transposed"] else w  # [d_model, heads * head_dim]
    dz = (clean[("z", layer)] - corrupt[("z", layer)])[:, h * hd:(h + 1) * hd]
    return dz @ w[:, h * hd:(h + 1) * hd].T


def _moved(m, shape, receiver, delta):
    """Hooks that add `delta` [n, d_model] to `receiver`'s own input only: its projection (or MLP)
    recomputed from the moved stream, every other reader of the stream untouched."""
    lay = LAYOUT[shape.family.name]
    n = len(delta)
    if receiver == LOGITS:
        final = get_module(m, lay["final"])

        def add(mod, a):
            x = a[0].clone()
            x[0, :n] += delta
            return (x,) + a[1:]
        return [final.register_forward_pre_hook(add)]
    what, layer, *rest = receiver.split(".")
    block = _layers(m, shape)[int(layer)]
    seen = {}
    if what == "mlp_in":
        norm2, mlp = get_module(block, lay["norm2"]), get_module(block, lay["mlp"])

        def remember(mod, a):
            seen["x"] = a[0]

        def redo(mod, a, out):
            x = seen["x"].clone()
            x[0, :n] += delta
            return mlp.__class__.forward(mlp, norm2(x))
        return [norm2.register_forward_pre_hook(remember), mlp.register_forward_hook(redo)]
    path, which = lay["proj"][what]
    proj, norm1 = get_module(block, path), get_module(block, lay["norm1"])
    hd, unit = shape.head_dim, int(rest[0])
    width = shape.n_heads * hd
    first = which * width + unit * hd  # gpt2: q, k, v side by side in one projection
    hooks_seen = {}

    def remember_x(mod, a):
        hooks_seen["x"] = a[0]

    def redo_proj(mod, a, out):
        x = hooks_seen["x"].clone()
        x[0, :n] += delta
        moved = proj.__class__.forward(proj, norm1(x))
        out = out.clone()
        out[..., first:first + hd] = moved[..., first:first + hd]
        return out
    return [block.register_forward_pre_hook(remember_x), proj.register_forward_hook(redo_proj)]


def _fd_score(m, shape, pair, sender_delta, receiver, eps=1e-2) -> float:
    # the norms compute in float32 even in a float64 model: a step large enough to stay above their
    # rounding (central differences: the error is the curvature's, eps squared)
    vals = []
    for s in (1, -1):
        hooks = _moved(m, shape, receiver, s * eps * sender_delta)
        try:
            vals.append(_metric(m, pair))
        finally:
            for h in hooks:
                h.remove()
    return (vals[0] - vals[1]) / (2 * eps)


def _some_edges(graph: EdgeGraph) -> list[tuple[str, str]]:
    """Edges into each kind of receiver input, from each kind of sender."""
    L = graph.n_layers
    want = [(INPUT, "q.1.2"), ("head.0.3", "k.2.1"), ("mlp_out.1", "v.3.0"), ("head.1.1", "mlp_in.1"),
            ("head.2.0", LOGITS), (f"mlp_out.{L - 1}", LOGITS), (INPUT, "mlp_in.0"), ("head.0.1", "q.3.3")]
    return [(s, r) for s, r in want if graph.reaches(s, r)]


@pytest.mark.parametrize("model", TINY)
def test_eap_scores_equal_finite_differences_at_each_receivers_own_input(tokenizers, model):
    m, shape = _model64(model)
    scorer = EdgeScorer(Attributor(m, shape))
    pairs = _pairs(tokenizers, model)  # the first has answers of several tokens
    scores = scorer.scores(pairs[:2])
    graph = scorer.graph
    if shape.family.name not in LAYOUT:
        pytest.skip(f"no layout written for {shape.family.name}")
    checked = 0
    for b, pair in enumerate(pairs[:2]):
        clean, corrupt = _capture(m, shape, pair.clean_ids), _capture(m, shape, pair.corrupt_ids)
        for sender, receiver in _some_edges(graph):
            fd = _fd_score(m, shape, pair, _sender_delta(m, shape, clean, corrupt, sender), receiver)
            got = float(scores[b][graph.senders.index(sender), graph.receivers.index(receiver)])
            assert got == pytest.approx(fd, abs=5e-5, rel=2e-3), (pair.pair_id, sender, receiver)
            checked += 1
    assert checked >= 12
    # the scores move: a check of zeros would prove nothing
    assert max(float(s.abs().max()) for s in scores) > 0.05


def test_scores_into_the_logits_sum_to_attribution_patchings_estimate_at_the_final_stream(tokenizers):
    m, shape = _model64("tiny-llama")
    att = Attributor(m, shape)
    pairs = _pairs(tokenizers, "tiny-llama")
    scores = EdgeScorer(att).scores(pairs)
    est = att.estimate(pairs, ("resid",))
    for b, pair in enumerate(pairs):
        n = len(pair.corrupt_ids)
        want = float(est[b]["resid"]["estimate"][shape.n_layers - 1, n, 0])  # every position at once
        assert float(scores[b][:, -1].sum()) == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_eap_ig_with_one_step_is_eap_and_with_more_averages_the_interpolated_gradients(tokenizers):
    m, shape = _model64("tiny-llama")
    scorer = EdgeScorer(Attributor(m, shape))
    pairs = _pairs(tokenizers, "tiny-llama")[1:3]
    eap = scorer.scores(pairs, "eap")
    assert all(torch.equal(a, b) for a, b in zip(scorer.scores(pairs, "eap-ig", steps=1), eap))
    ig = scorer.scores(pairs, "eap-ig", steps=2)
    graph = scorer.graph
    pair = pairs[0]
    clean, corrupt = _capture(m, shape, pair.clean_ids), _capture(m, shape, pair.corrupt_ids)
    layer0 = _layers(m, shape)[0]
    n = len(pair.corrupt_ids)
    dx = clean[("x", 0)] - corrupt[("x", 0)]
    for sender, receiver in _some_edges(graph)[:4]:
        delta = _sender_delta(m, shape, clean, corrupt, sender)
        grads = []
        for k in range(2):  # the input moved k/2 of the way from corrupt to clean
            def lerp(mod, a, k=k):
                x = a[0].clone()
                x[0, :n] += (k / 2) * dx
                return (x,) + a[1:]
            h = layer0.register_forward_pre_hook(lerp)
            try:
                grads.append(_fd_score(m, shape, pair, delta, receiver))
            finally:
                h.remove()
        got = float(ig[0][graph.senders.index(sender), graph.receivers.index(receiver)])
        assert got == pytest.approx(sum(grads) / 2, abs=5e-5, rel=2e-3), (sender, receiver)
    assert any(not torch.equal(a, b) for a, b in zip(ig, eap))


def test_per_position_scores_sum_to_the_position_agnostic_ones(tokenizers):
    m, shape = _model64("tiny-gpt2")
    scorer = EdgeScorer(Attributor(m, shape))
    pairs = _pairs(tokenizers, "tiny-gpt2")
    summed = scorer.scores(pairs)
    each = scorer.scores(pairs, per_position=True)
    for s, e in zip(summed, each):
        assert e.shape[0] == len(pairs[0].corrupt_ids) or e.shape[0] > 1
        torch.testing.assert_close(e.sum(0), s, rtol=1e-10, atol=1e-12)


def _shape(family, layers=3, heads=4, kv=2) -> ModelShape:
    return ModelShape(FAMILIES[family], layers, heads, 8, 32, 100, 64, 64, kv)


def test_the_graph_has_every_edge_from_an_earlier_node_into_a_later_input():
    g = EdgeGraph.of(_shape("llama"))
    L, H, G = 3, 4, 2
    assert len(g.senders) == 1 + L * (H + 1)
    assert len(g.receivers) == L * (H + 2 * G + 1) + 1
    # into layer l's head inputs: the input and every head and MLP before it; into its MLP: its
    # heads too; into the logits: every sender
    want = sum((H + 2 * G) * (1 + l * (H + 1)) + (1 + l * (H + 1) + H) for l in range(L)) + len(g.senders)
    assert len(g.edges) == want == int(g.mask().sum())
    assert g.reaches("head.1.0", "mlp_in.1") and not g.reaches("mlp_out.1", "mlp_in.1")
    assert not g.reaches("head.1.0", "q.1.0") and g.reaches("mlp_out.0", "k.1.1")
    # a parallel block: a layer's MLP reads the layer's input, before its heads write
    par = EdgeGraph.of(_shape("gptj", kv=4))
    assert not par.reaches("head.1.0", "mlp_in.1") and par.reaches("head.0.0", "mlp_in.1")


@pytest.mark.parametrize("family", ["gemma2", "olmo2"])
def test_a_family_that_normalises_attentions_summed_output_is_refused(family):
    with pytest.raises(GraphError, match="no head has an output of its own"):
        check_splittable(_shape(family))


def test_the_edges_sweep_refuses_a_family_whose_heads_cannot_be_nodes():
    from patchgrid.sweeps import SweepConfig
    from patchgrid.sweeps.run import check_family

    with pytest.raises(ValueError, match="sweep edges: the gemma2 family normalises"):
        check_family(SweepConfig(sweeps=("edges",)), FAMILIES["gemma2"])

