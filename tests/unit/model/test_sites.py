"""patchgrid.model.sites: which sites a family lacks, site names and keys parsed back, a model's shape
read from its config, and vLLM's paths of a family."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from patchgrid.model.sites import (
    FAMILIES,
    GEMMA,
    GPT2,
    GPT_NEOX,
    GPTJ,
    LLAMA,
    OLMO2,
    PATCHABLE,
    QWEN3_MOE,
    SITES,
    family_of,
    parse_key,
    parse_unit_name,
    shape_of,
    site_key,
    unit_name,
)


@pytest.mark.parametrize("family", [GPTJ, GPT_NEOX])
def test_a_parallel_block_has_no_resid_mid_and_says_why(family):
    why = family.missing("resid_mid")
    assert why == (f"the {family.name} block is parallel: attention and MLP both read the layer's input "
                   "(resid_pre), so no stream exists between them")


def test_a_mixture_of_experts_has_no_neuron_and_says_why():
    assert QWEN3_MOE.missing("neuron") == ("the qwen3_moe MLP is a mixture of experts, with no one down projection "
                                           "whose input is a neuron")
    assert QWEN3_MOE.missing("mlp_out") is None and QWEN3_MOE.missing("resid_mid") is None


@pytest.mark.parametrize("family", sorted(set(FAMILIES.values()), key=lambda f: f.name), ids=lambda f: f.name)
def test_a_family_lacks_only_resid_mid_when_parallel_and_neuron_when_a_mixture(family):
    lacking = {site for site in SITES if family.missing(site) is not None}
    want = {"resid_mid"} if family.mlp_norm is None else set()
    if family.experts:
        want.add("neuron")
    assert lacking == want


def test_olmo2_reads_resid_mid_at_its_mlp_input():
    assert OLMO2.missing("resid_mid") is None and OLMO2.module_of("mlp_norm") == "mlp"


def test_where_each_role_lives():
    assert LLAMA.module_of("attn_out") == "self_attn" and LLAMA.module_of("mlp_out") == "mlp"
    assert GEMMA.module_of("attn_out") == "post_attention_layernorm"  # the norm after attention
    assert GEMMA.module_of("mlp_out") == "post_feedforward_layernorm"
    assert GEMMA.module_of("mlp_norm") == "pre_feedforward_layernorm"
    assert GPT2.module_of("o_proj") == "attn.c_proj" and GPT2.module_of("down_proj") == "mlp.c_proj"
    assert LLAMA.decoder == "model" and GPT2.decoder == "transformer"


def test_vllm_moves_the_model_level_paths_of_a_family_it_holds_elsewhere():
    moved = GPT_NEOX.in_vllm()
    assert (moved.layers, moved.embed, moved.final_norm) == ("model.layers", "model.embed_in",
                                                             "model.final_layer_norm")
    assert moved.attn == GPT_NEOX.attn and moved.down_proj == GPT_NEOX.down_proj  # layer-relative: unchanged
    assert LLAMA.in_vllm() is LLAMA
    with pytest.raises(ValueError, match="family gpt_neox: embed_out is not under the decoder gpt_neox"):
        replace(GPT_NEOX, embed="embed_out").in_vllm()


@pytest.mark.parametrize("text, parsed", [
    ("head.3.2", ("head", 3, 2)),
    ("q.5.1", ("q", 5, 1)),
    ("k.0.1", ("k", 0, 1)),
    ("neuron.2.17", ("neuron", 2, 17)),
    ("attn_out.3", ("attn_out", 3, None)),
    ("resid_pre.0", ("resid_pre", 0, None)),
    ("mlp_out.11", ("mlp_out", 11, None)),
    ("embed", ("embed", None, None)),
])
def test_unit_names_parse_back(text, parsed):
    assert parse_unit_name(text) == parsed
    assert unit_name(*parsed) == text


@pytest.mark.parametrize("text", ["head.3", "attn_out.3.1", "bogus.1", "head.x.2", "embed.0", "resid", "resid.-1",
                                  "head.3.2.1", ""])
def test_bad_unit_names_are_refused(text):
    with pytest.raises(ValueError, match=f"bad site name {text!r}: expected e.g. head.3.2"):
        parse_unit_name(text)


@pytest.mark.parametrize("key, parsed", [("embed", ("embed", None)), ("resid.3", ("resid", 3)),
                                         ("resid_pre.0", ("resid_pre", 0)), ("head.12", ("head", 12)),
                                         ("neuron.1", ("neuron", 1)), ("pattern.2", ("pattern", 2))])
def test_site_keys_parse_back(key, parsed):
    assert parse_key(key) == parsed
    assert site_key(*parsed) == key


@pytest.mark.parametrize("key", ["resid", "resid.x", "bogus.1", "embed.0", "resid.-1", "head.3.2", ".3"])
def test_bad_site_keys_are_refused(key):
    with pytest.raises(ValueError, match=f"bad site key {key!r}"):
        parse_key(key)


def test_the_embedding_has_one_key_whatever_the_layer():
    assert site_key("embed", None) == site_key("embed", 5) == "embed"


def test_units_and_what_is_patchable():
    assert SITES["k"].unit_field == "head" and SITES["v"].unit == "kv_head"
    assert SITES["neuron"].unit_field == "neuron" and SITES["resid"].unit_field is None
    assert SITES["pattern"].unit == "head"  # patched one head at a time (backends.patterns.attend)
    assert set(PATCHABLE) == set(SITES)


def _llama_config(**change):
    config = dict(model_type="llama", num_attention_heads=8, hidden_size=64, num_hidden_layers=4, vocab_size=100,
                  max_position_embeddings=256, intermediate_size=128, num_key_value_heads=2)
    return SimpleNamespace(**(config | change))


def test_the_shape_of_a_grouped_query_model():
    shape = shape_of(_llama_config())
    assert shape.family is LLAMA
    assert (shape.n_layers, shape.n_heads, shape.head_dim, shape.d_model) == (4, 8, 8, 64)  # head_dim 64 / 8
    assert (shape.vocab_size, shape.max_len, shape.d_mlp, shape.kv_heads) == (100, 256, 128, 2)
    assert not shape.soft_capped
    # widths: every head's z and q, every key/value head, the MLP's neurons, else the stream
    assert [shape.width(s) for s in ("head", "q", "k", "v", "neuron", "resid", "embed")] == [64, 64, 16, 16, 128, 64,
                                                                                              64]
    assert [shape.units(s) for s in ("head", "q", "k", "neuron", "resid")] == [8, 8, 2, 128, 0]
    assert shape.unit_width("neuron") == 1 and shape.unit_width("k") == 8


def test_a_config_head_dim_and_soft_cap_are_read():
    shape = shape_of(_llama_config(head_dim=32, attn_logit_softcapping=50.0, num_key_value_heads=None))
    assert shape.head_dim == 32 and shape.soft_capped and shape.kv_heads == 8
    assert shape.width("head") == 8 * 32


def test_gpt2_defaults_its_mlp_to_four_times_the_stream_and_its_length_to_n_positions():
    config = SimpleNamespace(model_type="gpt2", num_attention_heads=4, hidden_size=32, num_hidden_layers=2,
                             vocab_size=50, n_positions=64, n_inner=None)
    shape = shape_of(config)
    assert shape.family is GPT2 and shape.d_mlp == 128 and shape.max_len == 64 and shape.head_dim == 8


def test_unknown_and_unsupported_models_are_refused():
    with pytest.raises(ValueError, match="model type 'mamba' has no site mapping; supported: gemma2, gemma3_text"):
        family_of("mamba")
    config = SimpleNamespace(model_type="gpt_neox", use_parallel_residual=False)
    with pytest.raises(ValueError, match="'gpt_neox' with use_parallel_residual=False is not supported"):
        shape_of(config)
