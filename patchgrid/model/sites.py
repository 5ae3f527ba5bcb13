"""Site names and where each lives in a model family.

A site is a place in the forward pass whose activation can be read or overwritten:

    embed      token embedding output              [tokens, d_model]  (gemma: scaled by sqrt(d_model))
    resid_pre  a layer's input, the whole stream   [tokens, d_model]  (layer 0: what the first
               layer reads: the token embedding; gpt2: token + position embeddings)
    resid_mid  the whole stream after the layer's attention, before its MLP [tokens, d_model]; a
               parallel block (gptj, gpt_neox) has none (Family.missing)
    resid      a layer's output, the whole stream  [tokens, d_model]  (= resid_pre of the next)
    attn_out   what the layer's attention adds to the stream [tokens, d_model]: its output, or the
               output of the norm after it (gemma, olmo2)
    mlp_out    what the layer's MLP adds to the stream, likewise [tokens, d_model]
    q, k, v    one head's query, key or value as attention reads it: after the projections (and
               the q/k norms of qwen3, gemma3 and olmo2), after the rotary embedding for q and k
               (gpt2 has none; gptj and gpt_neox rotate only the first dims of each head)
               [tokens, head_dim] of [tokens, heads*head_dim]; with grouped-query
               attention k and v have one head per key/value head, and their head index is that
    head       one head's slice of z (o_proj input) [tokens, head_dim] of z [tokens, n_heads*head_dim]
    neuron     one MLP neuron: a column of the down projection's input [tokens, 1] of [tokens, d_mlp]
               (llama: act(gate) * up; gpt2: act(c_fc))
    pattern    the attention pattern [query tokens, n_heads * key tokens]; vLLM never holds it, so its
               worker computes it from the kernel's q and k. Patched one head at a time: the head's
               output at the patched positions becomes the source's pattern applied to this run's
               own values (backends.patterns.attend), everything else as it is

`SITES` says, per site kind, which module of a family it lives on, whether it is read at that
module's input or output, and how wide it is; both backends install their hooks from it. Adding a
site kind is one `Site` entry; adding a model family is one `Family` entry (module paths are the
same in Hugging Face transformers and vLLM, so both backends read one mapping; where vLLM holds the
decoder elsewhere, `Family.vllm_decoder` says where and `Family.in_vllm` moves the paths).
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Site:
    name: str
    module: str  # the Family field naming its module: embed (model-level), layer, attn, mlp, o_proj, down_proj,
    # mlp_norm, attn_out, mlp_out
    # "output": the module's output; "input": the stream or tensor it reads (its first positional
    # input, or for a layer of a split-residual family the sum of its two stream inputs); "attention":
    # q, k or v as the attention computation reads them (see the backends)
    at: str
    # "d_model"; "z": every head's output side by side (n_heads * head_dim); "q": every query head;
    # "kv": every key/value head (n_kv_heads * head_dim); "mlp": the MLP's hidden width (d_mlp);
    # "pattern": per query token, every head's weights over the key tokens. z, q, kv and mlp are split
    # over tensor-parallel ranks, by heads and by neurons.
    width: str
    # A site patched one unit at a time: "head" (head_dim columns each), "kv_head" (a key/value head's
    # head_dim columns) or "neuron" (one column).
    unit: str | None = None
    patchable: bool = True  # False: read only

    @property
    def unit_field(self) -> str | None:
        """The Patch / Cell / effect-row field holding the unit's index (a key/value head is a head)."""
        return None if self.unit is None else "neuron" if self.unit == "neuron" else "head"


SITES = {site.name: site for site in (
    Site("embed", "embed", "output", "d_model"),
    Site("resid_pre", "layer", "input", "d_model"),
    Site("resid_mid", "mlp_norm", "input", "d_model"),
    Site("resid", "layer", "output", "d_model"),
    Site("attn_out", "attn_out", "output", "d_model"),
    Site("mlp_out", "mlp_out", "output", "d_model"),
    Site("q", "attn", "attention", "q", "head"),
    Site("k", "attn", "attention", "kv", "kv_head"),
    Site("v", "attn", "attention", "kv", "kv_head"),
    Site("head", "o_proj", "input", "z", "head"),
    Site("neuron", "down_proj", "input", "mlp", "neuron"),
    Site("pattern", "attn", "attention", "pattern", "head"),
)}
PATCHABLE = tuple(name for name, site in SITES.items() if site.patchable)
QKV = ("q", "k", "v")  # the sites read where attention is computed (Site.at == "attention")
SITE_KINDS = tuple(SITES)
LAYER_SITES = tuple(name for name, site in SITES.items() if site.module != "embed")


@dataclass(frozen=True)
class Family:
    name: str
    layers: str  # dotted path from the causal-LM module to the list of layers
    embed: str  # dotted path from the causal-LM module to the token embedding
    attn: str  # relative to a layer
    mlp: str  # relative to a layer
    o_proj: str  # relative to a layer; its input is z
    # vLLM's layers of this family return (hidden, residual) whose sum is the stream.
    split_residual: bool
    # Which positional input of a layer is the stream it reads (vLLM's call): a forward that starts
    # mid-stack hands the cached stream in there (transformers' layers, in vLLM's Transformers
    # backend, read it first). A family whose vLLM decoder cannot start mid-stack says None; its
    # patched runs then run every layer.
    stream_arg: int | None
    final_norm: str  # dotted path from the causal-LM module to the norm before the unembedding
    down_proj: str  # relative to a layer: the MLP's output projection; its input is the neurons
    # relative to a layer: the module whose input is the stream after attention (resid_mid): the norm
    # before the MLP, or the MLP itself where none precedes it (OLMo 2). None: a parallel block, whose
    # attention and MLP both read the layer's input, so no stream exists between them.
    mlp_norm: str | None
    # relative to the attention module: vLLM's attention-kernel module, called with (q, k, v) after
    # the rotary embedding (transformers has no module there: its hf backend reads q, k and v through
    # the attention function, patchgrid.backends.hf)
    attn_kernel: str = "attn"
    # The MLP is a mixture of experts: its output (mlp_out) is the routed experts' weighted sum, and
    # there is no one down projection whose input is a neuron (transformers loops over fused expert
    # weights, vLLM runs a fused-MoE kernel): the neuron site is refused.
    experts: bool = False
    # Relative to a layer: the module whose output is what attention (the MLP) adds to the stream,
    # where a norm follows the sublayer (Gemma 2/3, OLMo 2: the post-norm's output, so that
    # resid_mid = resid_pre + attn_out). None: the attention (MLP) module itself.
    attn_out: str | None = None
    mlp_out: str | None = None
    # Gemma multiplies the token embedding by sqrt(d_model): transformers inside its embedding module,
    # vLLM after it (by the decoder's `normalizer`). `embed` is the scaled embedding in both.
    embed_scaled: bool = False
    # transformers' attention module of this family computes attention in this method from
    # (query, key, value, mask), bypassing transformers' attention interface (GPT-J: `_attn`); the hf
    # backend reads q, k and v there. None: through the attention interface.
    hf_attn_method: str | None = None
    # vLLM has no model of its own for this family and runs transformers' modules through its
    # Transformers backend (TransformersForCausalLM), which (vLLM 0.32.0) decorates transformers' decoder
    # class in place, breaking transformers models of that class in the same process (so the engine
    # always runs in a process of its own); calls every module with a batch of one ([1, tokens, d]); and
    # calls the attention kernel through its `forward`, past module hooks.
    vllm_transformers: bool = False
    # vLLM's path from its causal-LM module to the module owning the layers, where it differs from
    # transformers' (`decoder`: GPT-NeoX's `gpt_neox` is `model` in vLLM's Transformers backend).
    vllm_decoder: str | None = None
    # A config attribute that must be true for this mapping to hold (GPT-NeoX: use_parallel_residual,
    # without which the block is sequential and mlp_norm would have to name its resid_mid).
    requires: str | None = None
    # The config attribute holding the cap the model's forward puts on its final logits,
    # cap * tanh(logits / cap) (Gemma 2 and 3: final_logit_softcapping; no cap where it is None). The hf
    # backend caps its float32 logits by it (backends.unembed); vLLM's logits processor caps by its own.
    final_softcap: str | None = None
    # Relative to a layer: the norm attention reads the stream through (None: attention reads the
    # stream itself, OLMo 2). A circuit run (backends.edge_ablation) normalises each receiver's own
    # input with it.
    attn_norm: str | None = None

    def module_of(self, where: str) -> str:
        """The dotted path of a Site.module role relative to a layer."""
        if where == "attn_out":
            return self.attn_out or self.attn
        if where == "mlp_out":
            return self.mlp_out or self.mlp
        return getattr(self, where)

    def missing(self, site: str) -> str | None:
        """Why this family has no such site, or None where it has it."""
        if SITES[site].module == "mlp_norm" and self.mlp_norm is None:
            return (f"the {self.name} block is parallel: attention and MLP both read the layer's input "
                    "(resid_pre), so no stream exists between them")
        if SITES[site].module == "down_proj" and self.experts:
            return f"the {self.name} MLP is a mixture of experts, with no one down projection whose input is a neuron"
        return None

    @property
    def decoder(self) -> str:
        """The module that owns the layers (vLLM's decoder loops over layers[start_layer:])."""
        return self.layers.rsplit(".", 1)[0]

    def in_vllm(self) -> Family:
        """This family with its model-level paths (layers, embed, final_norm) as vLLM's model holds them."""
        if self.vllm_decoder is None:
            return self
        hf = self.decoder + "."

        def moved(path: str) -> str:
            if not path.startswith(hf):
                raise ValueError(f"family {self.name}: {path} is not under the decoder {self.decoder}")
            return f"{self.vllm_decoder}.{path[len(hf):]}"

        return replace(self, layers=moved(self.layers), embed=moved(self.embed), final_norm=moved(self.final_norm))


# vLLM: LlamaDecoderLayer(positions, hidden_states, residual); GPT2Block(hidden_states)
LLAMA = Family("llama", "model.layers", "model.embed_tokens", "self_attn", "mlp", "self_attn.o_proj", True, 1,
               "model.norm", "mlp.down_proj", "post_attention_layernorm", attn_norm="input_layernorm")
GPT2 = Family("gpt2", "transformer.h", "transformer.wte", "attn", "mlp", "attn.c_proj", False, 0, "transformer.ln_f",
              "mlp.c_proj", "ln_2", attn_norm="ln_1")

# Qwen3-MoE: Llama's paths and stream; its sparse MLP block sits where Llama's MLP does.
QWEN3_MOE = Family("qwen3_moe", "model.layers", "model.embed_tokens", "self_attn", "mlp", "self_attn.o_proj", True,
                   1, "model.norm", "mlp.down_proj", "post_attention_layernorm", experts=True,
                   attn_norm="input_layernorm")

# Gemma 2 / 3: norms after attention and after the MLP (their outputs are what the stream receives:
# attn_out, mlp_out) and one before the MLP (resid_mid is its input); the embedding scaled by
# sqrt(d_model). vLLM: Gemma2DecoderLayer(positions, hidden_states, residual), as Llama's.
GEMMA = Family("gemma2", "model.layers", "model.embed_tokens", "self_attn", "mlp", "self_attn.o_proj", True, 1,
               "model.norm", "mlp.down_proj", "pre_feedforward_layernorm", attn_out="post_attention_layernorm",
               mlp_out="post_feedforward_layernorm", embed_scaled=True, final_softcap="final_logit_softcapping",
               attn_norm="input_layernorm")
# GPT-J: a parallel block, out = x + attn(ln_1(x)) + mlp(ln_1(x)): attn_out and mlp_out are the two
# terms, and there is no resid_mid. vLLM: GPTJBlock(position_ids, hidden_states) -> hidden_states;
# transformers' GPT-J computes attention in its own `_attn`, not through the attention interface.
GPTJ = Family("gptj", "transformer.h", "transformer.wte", "attn", "mlp", "attn.out_proj", False, 1, "transformer.ln_f",
              "mlp.fc_out", None, hf_attn_method="_attn", attn_norm="ln_1")
# GPT-NeoX (Pythia) with a parallel block: attention and MLP both read the layer's input (no resid_mid).
# vLLM runs it through its Transformers backend, whose decoder is `model` where transformers' is `gpt_neox`.
GPT_NEOX = Family("gpt_neox", "gpt_neox.layers", "gpt_neox.embed_in", "attention", "mlp", "attention.dense", False,
                  0, "gpt_neox.final_layer_norm", "mlp.dense_4h_to_h", None, vllm_transformers=True,
                  vllm_decoder="model", requires="use_parallel_residual",
                  attn_norm="input_layernorm")
# OLMo 2: no norm before attention or MLP; a norm after each, whose output is what the stream receives;
# the MLP reads the stream after attention itself.
OLMO2 = Family("olmo2", "model.layers", "model.embed_tokens", "self_attn", "mlp", "self_attn.o_proj", False, 0,
               "model.norm", "mlp.down_proj", "mlp", attn_out="post_attention_layernorm",
               mlp_out="post_feedforward_layernorm", vllm_transformers=True)

FAMILIES = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": LLAMA,
    "qwen3": LLAMA,
    "phi3": LLAMA,  # vLLM runs Phi-3 as its Llama (fused qkv and gate/up projections are not sites)
    "qwen3_moe": QWEN3_MOE,
    "gpt2": GPT2,
    "gemma2": GEMMA,
    # Gemma 3 1B; the larger, multimodal checkpoints (model_type gemma3) keep the text stack elsewhere
    "gemma3_text": GEMMA,
    "gptj": GPTJ,
    "gpt_neox": GPT_NEOX,
    "olmo2": OLMO2,
}


@dataclass(frozen=True)
class ModelShape:
    """What plans are validated against."""

    family: Family
    n_layers: int
    n_heads: int
    head_dim: int
    d_model: int
    vocab_size: int
    max_len: int
    d_mlp: int = 0  # the MLP's hidden width (neurons per layer)
    n_kv_heads: int = 0  # key/value heads (grouped-query attention); 0: as many as query heads
    # The attention scores are soft-capped before the softmax (Gemma 2), which transformers' sdpa
    # silently leaves out: transformers must run the model's eager attention.
    soft_capped: bool = False

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    def width(self, site: str) -> int:
        return {"z": self.n_heads * self.head_dim, "q": self.n_heads * self.head_dim,
                "kv": self.kv_heads * self.head_dim, "mlp": self.d_mlp}.get(SITES[site].width, self.d_model)

    def units(self, site: str) -> int:
        """How many units (heads, key/value heads, neurons) a site of this kind has per layer; 0: not
        patched by unit."""
        return {"head": self.n_heads, "kv_head": self.kv_heads, "neuron": self.d_mlp}.get(SITES[site].unit, 0)

    def unit_width(self, site: str) -> int:
        """The columns of the site's tensor one unit spans."""
        return 1 if SITES[site].unit == "neuron" else self.head_dim


def family_of(model_type: str) -> Family:
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(
            f"model type {model_type!r} has no site mapping; supported: {', '.join(sorted(FAMILIES))}"
        ) from None


def shape_of(config) -> ModelShape:
    """ModelShape from a transformers config."""
    family = family_of(config.model_type)
    if family.requires and not getattr(config, family.requires, False):
        value = getattr(config, family.requires, None)
        raise ValueError(f"model type {config.model_type!r} with {family.requires}={value}"
                         f" is not supported: patchgrid maps only {family.requires}=True models of this family")
    n_heads = config.num_attention_heads
    d_model = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or d_model // n_heads
    max_len = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 2048)
    # gpt2 names it n_inner, None meaning 4 x d_model
    d_mlp = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * d_model
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    return ModelShape(family, config.num_hidden_layers, n_heads, head_dim, d_model, config.vocab_size, max_len, d_mlp,
                      n_kv, bool(getattr(config, "attn_logit_softcapping", None)))


def site_key(site: str, layer: int | None) -> str:
    """Name of a captured tensor: `embed`, `resid_pre.3`, `resid.3`, `attn_out.3`, `q.3`, `head.3` (z),
    `neuron.3` (the down projection's input), ..."""
    return "embed" if site == "embed" else f"{site}.{layer}"


LOGITS = "logits"  # the receiver of a path straight to the unembedding


def unit_name(site: str, layer: int | None, unit: int | None = None) -> str:
    """A site at a layer, or one unit of it, as text: `head.3.2`, `q.5.1`, `attn_out.3`, `embed`
    (what names a path's sender and receiver)."""
    key = site_key(site, layer)
    return key if unit is None else f"{key}.{unit}"


def parse_unit_name(text: str) -> tuple[str, int | None, int | None]:
    """(site, layer, unit) from `unit_name`'s text; a unit is required exactly for sites patched by unit."""
    parts = text.split(".")
    site = parts[0]
    want = 1 + (site in LAYER_SITES) + (site in SITES and SITES[site].unit is not None)
    if site not in SITES or len(parts) != want or not all(x.isdigit() for x in parts[1:]):
        raise ValueError(f"bad site name {text!r}: expected e.g. head.3.2 (site.layer.head), attn_out.3 or q.5.1")
    nums = [int(x) for x in parts[1:]] + [None, None]
    return (site, None, None) if site == "embed" else (site, nums[0], nums[1])


def parse_key(key: str) -> tuple[str, int | None]:
    if key == "embed":
        return "embed", None
    site, _, layer = key.rpartition(".")
    if site not in LAYER_SITES or not layer.isdigit():
        raise ValueError(f"bad site key {key!r}: expected embed or one of {LAYER_SITES} with a layer, e.g. resid.3")
    return site, int(layer)


def site_module(model, family: Family, site: str, layer: int | None):
    """The module whose input or output is `site` at `layer` in a causal-LM `model` of `family`."""
    where = SITES[site].module
    if where == "embed":
        return get_module(model, family.embed)
    block = get_module(model, family.layers)[layer]
    return block if where == "layer" else get_module(block, family.module_of(where))


def get_module(root, dotted: str):
    mod = root
    for part in dotted.split("."):
        mod = mod[int(part)] if part.isdigit() else getattr(mod, part)
    return mod
