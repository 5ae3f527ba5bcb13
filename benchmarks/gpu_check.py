"""The GPU check: what patchgrid computes on a CUDA device equals its CPU float32 reference.

Needs only torch (a CUDA build) and transformers on the GPU machine, and this checkout: no vLLM,
no warehouse or flow packages. Three parts, on the project's tiny seeded models (patchgrid.model.models,
built locally, no hub):

  hf           every site kind (patchgrid.model.sites.SITES) on the `hf` backend: the captures of a clean
               and a corrupt run at every site and layer, and the answer logits and logsumexp of a
               patched run at every site (tests/support/backends.every_site_requests), on the device
               against the same on the CPU in float32, every patched run given the CPU's captures
  attribution  attribution patching's estimates and GradDrop scores (patchgrid.methods.attribution.Attributor)
               at every site kind it estimates, on the device against the CPU's
  worker       the vLLM worker's step planning and every hook's write (backends/vllm_worker: the
               session, its site hooks, the mid-stack start and the logits readout) run with
               activations on the device, as tests/engine/backends/test_devices.py runs them on PyTorch's
               `meta` device, without vLLM; on a device with values, what the hooks wrote and read
               against the same on the CPU

It prints the machine, then one row per check (check, device, max abs difference, tolerance,
pass/fail), and exits 1 if any check fails. Without a CUDA device it refuses, unless given
`--device cpu` (every part on the CPU: a dry run of the script itself) or `--device meta` (the
worker part alone, on the meta device, which holds no values to compare).

    python benchmarks/gpu_check.py [--device cuda|cpu|meta] [--models tiny-llama,tiny-gpt2,...]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# every tiny model the check loads (one of each family patchgrid maps, and Llama's relatives)
MODELS = ("tiny-llama", "tiny-qwen3", "tiny-phi3", "tiny-qwen3-moe", "tiny-gpt2", "tiny-gemma2", "tiny-gemma3",
          "tiny-gptj", "tiny-neox", "tiny-olmo2")
# the worker part builds vLLM's call arguments by hand for the decoders vLLM runs itself: a split
# (hidden, residual) stream (Llama) and a plain one (GPT-2)
WORKER_MODELS = ("tiny-llama", "tiny-gpt2")
# float32 on two devices: the same operations in another order (another matmul kernel, another
# reduction tree) differ by a few float32 roundings of the activations' scale; 1e-4 is the
# project's own bound between two engines (tests/support/backends.TOL)
TOL_HF = 1e-4
# attribution estimates are sums of products over positions and widths: 1e-4 of their largest size
TOL_ATP_REL = 1e-4
# the worker's writes are copies (and one addition for noise): the same bits on every device
TOL_WRITES = 0.0
# the readout unembeds every read row in float32 (a matmul) and reduces over the vocabulary
# (logsumexp, KL): float32 in another order, as the hf part
TOL_READOUT = 1e-4
CLEAN = (21, 7, 143, 88, 301, 12, 9, 40)
CORRUPT = (21, 7, 250, 61, 301, 12, 9, 40)
ANSWERS = (5, 77)
LONG_ANSWERS = ((5, 11, 12), (77, 13))  # answers scored whole: several forwards
BUDGET_S = 480  # the whole check on a GPU machine, models built included


@dataclass
class Check:
    name: str
    device: str
    diff: float | None  # None: nothing to compare (the meta device), the check being that it ran
    tol: float | None
    ok: bool
    note: str = ""


def max_abs_diff(ref, got) -> float:
    """The largest |ref - got| over two tensors, or over the tensors of two equal structures (dicts,
    lists, tuples, numbers); inf where the structures, shapes or finiteness differ."""
    import torch

    if isinstance(ref, dict):
        if not isinstance(got, dict) or set(ref) != set(got):
            return float("inf")
        return max((max_abs_diff(ref[k], got[k]) for k in ref), default=0.0)
    if isinstance(ref, list | tuple):
        if not isinstance(got, list | tuple) or len(ref) != len(got):
            return float("inf")
        return max((max_abs_diff(a, b) for a, b in zip(ref, got)), default=0.0)
    if ref is None or got is None:
        return 0.0 if ref is None and got is None else float("inf")
    a = torch.as_tensor(ref).detach().to("cpu", torch.float64)
    b = torch.as_tensor(got).detach().to("cpu", torch.float64)
    if a.shape != b.shape or not torch.equal(a.isfinite(), b.isfinite()):
        return float("inf")
    if a.numel() == 0:
        return 0.0
    finite = a.isfinite()
    if not torch.equal(a[~finite], b[~finite]):  # an inf of the other sign
        return float("inf")
    return float((a[finite] - b[finite]).abs().max()) if finite.any() else 0.0


def compare(name: str, device: str, ref, got, tol: float, note: str = "") -> Check:
    """A check passing when every value of `got` is within `tol` of `ref`'s."""
    diff = max_abs_diff(ref, got)
    return Check(name, device, diff, tol, diff <= tol, note)


# ---- hf: every site kind ----
def _prepared(model: str):
    from transformers import AutoConfig

    from patchgrid.model.models import prepare
    from patchgrid.model.sites import shape_of

    folder = prepare(model)
    return folder, shape_of(AutoConfig.from_pretrained(folder))


def capture_keys(shape) -> list[str]:
    """Every site key the family has (pattern included: the hf backend reads it), at every layer."""
    from patchgrid.model.sites import SITES, site_key

    return ["embed"] + [site_key(s, layer) for s in SITES if s != "embed" and not shape.family.missing(s)
                        for layer in range(shape.n_layers)]


def _kind(key: str) -> str:
    return key.rpartition(".")[0] or key


def _hf_run(folder, shape, device: str, sources=None):
    """(captures of the clean and corrupt runs, the patched runs' results), on `device`."""
    from patchgrid.backends.hf import HFEngine
    from patchgrid.plan import Request
    from tests.support.backends import every_site_requests

    engine = HFEngine(folder, shape, dtype="float32", device=device)
    try:
        keys = tuple(capture_keys(shape))
        clean, corrupt = engine.run([Request(tokens=CLEAN, answers=ANSWERS, capture=keys),
                                     Request(tokens=CORRUPT, answers=ANSWERS, capture=keys)])
        captured = {"clean": clean.captures, "corrupt": corrupt.captures}
        requests = every_site_requests(shape, CORRUPT, ANSWERS)
        requests.append(Request(tokens=CORRUPT, continuations=LONG_ANSWERS))
        return captured, requests, engine.run(requests, sources or captured)
    finally:
        engine.close()


def hf_checks(model: str, device: str) -> list[Check]:
    """Per site kind: its captures and the patched runs at it, on `device` against the CPU."""
    folder, shape = _prepared(model)
    ref_caps, requests, ref = _hf_run(folder, shape, "cpu")
    got_caps, _, got = _hf_run(folder, shape, device, sources=ref_caps)
    checks = []
    for kind in dict.fromkeys(_kind(k) for k in ref_caps["clean"]):
        pick = {run: {k: v for k, v in caps.items() if _kind(k) == kind} for run, caps in ref_caps.items()}
        mine = {run: {k: v for k, v in caps.items() if _kind(k) == kind} for run, caps in got_caps.items()}
        runs = [i for i, r in enumerate(requests) if any(p.site == kind for p in r.patches)]
        diff = max(max_abs_diff(pick, mine),
                   max((max_abs_diff(_readings(ref[i]), _readings(got[i])) for i in runs), default=0.0))
        note = f"captures, {len(runs)} patched runs" if runs else "captures"
        checks.append(Check(f"hf {model}: {kind}", device, diff, TOL_HF, diff <= TOL_HF, note))
    rest = [i for i, r in enumerate(requests) if not r.patches]
    checks.append(compare(f"hf {model}: unpatched, noise, scored answers", device,
                          [_readings(ref[i]) for i in rest], [_readings(got[i]) for i in rest], TOL_HF,
                          f"{len(rest)} runs"))
    return checks


def _readings(result) -> dict:
    return {"answer_logits": result.answer_logits, "logsumexp": result.logsumexp,
            "continuations": [list(c) for c in result.continuation_logprobs]}


# ---- attribution ----
@dataclass(frozen=True)
class _Pair:
    """What Attributor.estimate reads of a pair (patchgrid.pairs.Pair, without pyarrow)."""

    clean_ids: tuple[int, ...]
    corrupt_ids: tuple[int, ...]
    continuations: tuple[tuple[int, ...], tuple[int, ...]]


def _estimates(folder, shape, device: str):
    from patchgrid.methods.attribution import ATP_SITES, Attributor

    pairs = [_Pair(CLEAN, CORRUPT, ((a,), (b,))) for a, b in (ANSWERS, (40, 9))] + [_Pair(CLEAN, CORRUPT, LONG_ANSWERS)]
    sites = [s for s in ATP_SITES if not shape.family.missing(s)]
    attributor = Attributor.load(folder, shape, dtype="float32", device=device)
    try:
        return sites, attributor.estimate(pairs, sites, correction="graddrop")
    finally:
        attributor.close()


def attribution_checks(model: str, device: str) -> list[Check]:
    folder, shape = _prepared(model)
    sites, ref = _estimates(folder, shape, "cpu")
    _, got = _estimates(folder, shape, device)
    checks = []
    for site in sites:
        for what in ("estimate", "graddrop"):
            r, g = [p[site][what] for p in ref], [p[site][what] for p in got]
            tol = TOL_ATP_REL * max(1.0, max(float(t.abs().max()) for t in r))
            checks.append(compare(f"attribution {model}: {site} {what}", device, r, g, tol, f"{len(r)} pairs"))
    return checks


# ---- the vLLM worker: planning and every hook ----
def worker_checks(model: str, device: str) -> list[Check]:
    """The worker's hooks with activations on `device`: every written tensor there (and on a device
    with values, what the hooks wrote, captured and read equal to the same on the CPU)."""
    checks = []
    for started in (False, True):
        label = f"worker {model}: {'mid-stack start' if started else 'planning, site hooks, readout'}"
        t0 = time.time()
        got, placed = _worker_pass(model, device, started)
        if device == "meta":
            ok = placed == ("meta", True)
            note = "every write on meta" if ok else f"a write on {placed[0]}"
            checks.append(Check(label, device, None, None, ok, note))
            continue
        ref, _ = _worker_pass(model, "cpu", started)
        counts = {"writes": f"{len(ref['writes'])} tensors",
                  "captures": f"{sum(map(len, ref['captures'].values()))} tensors",
                  "readout": f"{len(ref['readout'])} vLLM requests",
                  "unembedding": f"the final norm's rows, {time.time() - t0:.1f} s"}
        for part, tol in (("writes", TOL_WRITES), ("captures", TOL_WRITES), ("readout", TOL_READOUT),
                          ("unembedding", TOL_READOUT)):
            if ref[part] or got[part]:
                checks.append(compare(f"{label}: {part}", device, ref[part], got[part], tol, counts[part]))
    return checks


def _logits_processor():
    """vLLM's LogitsProcessor as the worker reads it: the head's product in `_apply_head`, which the
    readout replaces by its float32 one for its call."""
    import torch

    class LogitsProcessor(torch.nn.Module):
        def _apply_head(self, lm_head, hidden, bias):
            return torch.nn.functional.linear(hidden, lm_head.weight, bias)

        def forward(self, lm_head, hidden, bias=None):
            return self._apply_head(lm_head, hidden, bias)

    return LogitsProcessor()


def _worker_model(model: str, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    from patchgrid.model.sites import get_module, site_module

    folder, shape = _prepared(model)
    m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    fam = shape.family
    m.logits_processor = _logits_processor()  # vLLM's model unembeds through compute_logits and this
    m.compute_logits = lambda hidden: m.logits_processor(m.lm_head, hidden, m.lm_head.bias)
    get_module(m, fam.decoder).start_layer = 0  # vLLM's decoder attribute
    for layer in range(shape.n_layers):  # vLLM's attention-kernel module, given q, k and v
        attention = site_module(m, fam, "q", layer)
        if not hasattr(attention, fam.attn_kernel):
            setattr(attention, fam.attn_kernel, torch.nn.Identity())
    return m, shape


def _dims(shape) -> dict:
    return {"vocab_size": shape.vocab_size, "d_model": shape.d_model, "n_heads": shape.n_heads,
            "head_dim": shape.head_dim, "d_mlp": shape.d_mlp, "n_kv_heads": shape.kv_heads}


def _worker_requests(shape, started: bool, values: bool):
    """(requests, the site keys the call's hooks go on) for one step; captures and a reference only
    where the device holds values to copy out."""
    from patchgrid.plan import Noise, Patch, Request, Start

    f = shape.family
    mid = () if f.missing("resid_mid") else (Patch("resid_mid", 1, "clean", (4,)),)
    if started:
        patches = [(Patch("resid", 1, "clean", (3,)), Patch("attn_out", 2, "clean", (1, 4)),
                    Patch("head", 2, "clean", (5,), 1)),
                   (Patch("head", 2, "clean", None, 3), Patch("neuron", 3, "clean", (2,), neuron=7))]
        noises = [(), (Noise((2, 3), 0.5, 1),)]
        reqs = [Request(tokens=CORRUPT, answers=ANSWERS, start=Start(2, "corrupt"), patches=p, noise=z)
                for p, z in zip(patches, noises)]
        keys = ["resid.1", "attn_out.2", "head.2", "neuron.3"]
    else:
        first = (Patch("embed", None, "clean", (1,)), Patch("resid_pre", 1, "clean", (2, 3)), *mid,
                 Patch("resid", 1, "clean", (3,)), Patch("attn_out", 2, "clean", (1, 4)),
                 Patch("mlp_out", 2, "clean", (5,)), Patch("q", 1, "clean", (2,), 1), Patch("k", 1, "clean", (6,), 0),
                 Patch("v", 1, "clean", None, 1), Patch("head", 2, "clean", (5,), 1),
                 Patch("neuron", 3, "clean", (2,), neuron=7))
        second = (Patch("head", 2, "clean", None, 3), Patch("neuron", 3, "clean", (2,), neuron=7),
                  Patch("resid", 1, "clean", None))
        keys = ["embed", "resid_pre.1", "resid.1", "attn_out.2", "mlp_out.2", "q.1", "k.1", "v.1", "head.2",
                "neuron.3"] + ([] if f.missing("resid_mid") else ["resid_mid.1"])
        reqs = [Request(tokens=CORRUPT, answers=ANSWERS, patches=first, top_k=5,
                        capture=tuple(keys) if values else (), reference="clean" if values else None,
                        logprobs=values),
                Request(tokens=CORRUPT, answers=ANSWERS, patches=second, noise=(Noise((2, 3), 0.5, 1),)),
                Request(tokens=CLEAN, continuations=LONG_ANSWERS, patches=(Patch("mlp_out", 2, "clean", (6,)),))]
    return reqs, keys


def _wire_sources(shape, keys, seed: int = 0) -> dict:
    """The call's sources as the engine sends them: a value at every key, the stream a start reads,
    and reference log-probabilities; seeded, so that every device is given the same."""
    import torch

    from patchgrid.plan import LOGPROBS, encode_tensor

    g = torch.Generator().manual_seed(seed)
    rows = len(CLEAN) + sum(len(c) - 1 for c in LONG_ANSWERS)
    clean = {k: torch.randn(rows, shape.width(_kind(k)), generator=g) for k in keys}
    clean[LOGPROBS] = torch.log_softmax(torch.randn(shape.vocab_size, generator=g), 0)
    corrupt = {"resid.1": torch.randn(rows, shape.d_model, generator=g)}
    return {name: {k: encode_tensor(v) for k, v in caps.items()} for name, caps in
            (("clean", clean), ("corrupt", corrupt))}


def _runner(model, requests):
    """The parts of vLLM's V1 runner the worker reads, for one step holding every forward whole
    (as tests/engine/backends/test_devices.py builds it)."""
    from types import SimpleNamespace

    import numpy as np

    from patchgrid.backends.vllm_worker.held import request_id
    from patchgrid.plan import forwards, to_columns

    fwds = [(r, f) for r in requests for f in forwards(r)]
    # vLLM's ids: the one given (which names the call's plan k) and a random suffix
    vllm_requests = [(f"{request_id(0, k)}-0a1b2c3d", r, f) for k, (r, f) in enumerate(fwds)]
    lengths = [len(f.tokens) for _, _, f in vllm_requests]
    ids = [rid for rid, _, _ in vllm_requests]
    return SimpleNamespace(
        get_model=lambda: model,
        input_batch=SimpleNamespace(num_reqs=len(ids), req_ids=ids, num_computed_tokens_cpu=np.zeros(len(ids),
                                                                                                     dtype=np.int64)),
        query_start_loc=SimpleNamespace(np=np.cumsum([0] + lengths)),
        requests={rid: SimpleNamespace(prompt_token_ids=list(f.tokens)) for rid, _, f in vllm_requests},
    ), sum(lengths), to_columns(requests, [forwards(r) for r in requests])


class _Activations:
    """Seeded activations on a device, made on the CPU so that every device gets the same values;
    every tensor a hook was given or returned is kept, to be compared and its device checked."""

    def __init__(self, device: str, seed: int = 1):
        import torch

        self.device, self.seen, self.unembedded = device, [], None
        self.g = torch.Generator().manual_seed(seed)

    def make(self, *shape, dtype=None):
        import torch

        if dtype is torch.long:
            t = torch.arange(shape[0])
        else:
            t = torch.randn(*shape, generator=self.g)
        return t.to(self.device)

    def keep(self, *tensors):
        import torch

        self.seen += [t for t in tensors if isinstance(t, torch.Tensor)]


def _worker_pass(model_name: str, device: str, started: bool):
    """One step through the worker's hooks: (what they wrote, captured and read, moved to the CPU;
    (the device of a write not on `device`, or `device`), whether every write is there)."""
    import torch

    from patchgrid.backends.vllm_worker.results import decoded
    from patchgrid.backends.vllm_worker.session import Session
    from patchgrid.plan import decode_tensor

    model, shape = _worker_model(model_name, device)
    values = device != "meta"
    requests, keys = _worker_requests(shape, started, values)
    runner, n_rows, plans = _runner(model, requests)
    session = Session(runner, _wire_sources(shape, keys), keys, shape.family, _dims(shape),
                      start_layer=2 if started else 0, call=0, plans=plans)
    acts = _Activations(device)
    try:
        session._begin_step(None, ())
        step = session.step
        planned = [t for v in step.writes.values() for t in v] + [t for v in step.units.values() for t in v]
        planned += list(step.noise or ()) + list(step.start or ())
        (_run_started if started else _run_hooks)(session, shape, acts, n_rows)
    finally:
        session.remove()
    off = [t.device.type for t in planned + acts.seen if t.device.type != device]
    placed = (off[0] if off else device, not off)
    if not values:
        return None, placed
    wired = session.results.wire()
    captures, readout = {}, {name: torch.from_numpy(a) for name, a in decoded(wired).items()}
    for tag, part in sorted(wired["parts"].items()):
        captures[tag] = {k: decode_tensor(v) for k, v in part["captures"].items()}
        readout[tag] = {k: v for k, v in part.items() if k not in ("captures", "logprobs")}
        if part.get("logprobs") is not None:
            readout[tag]["logprobs"] = decode_tensor(part["logprobs"])
    writes = [t.detach().cpu() for t in acts.seen]
    unembedded = [] if acts.unembedded is None else [acts.unembedded.detach().cpu()]
    return {"writes": writes, "captures": captures, "readout": readout, "unembedding": unembedded}, placed


def _run_started(session, shape, acts, n_rows):
    """The hooks of a call started at layer 2, in forward order (test_devices' list): the start
    layer's input becomes the cached stream; the layers below it do not run."""
    import torch

    f = shape.family
    lead = (acts.make(n_rows, dtype=torch.long),) * f.stream_arg  # vLLM's positions
    args = lead + (acts.make(n_rows, shape.d_model),) + ((None,) if f.split_residual else ())
    new = session._on_start(None, args)
    acts.keep(new[f.stream_arg])
    _call_site_hooks(session, shape, acts, n_rows, ("attn_out.2", "head.2", "neuron.3"))


def _run_hooks(session, shape, acts, n_rows):
    """Every hook of an unstarted call, in forward order, then the logits readout."""
    embed = acts.make(n_rows, shape.d_model)
    out = session._on_embed(None, (), embed)
    acts.keep(embed if out is None else out)
    keys = ["resid_pre.1", "q.1", "k.1", "v.1", "head.2", "resid_mid.1", "attn_out.2", "mlp_out.2", "neuron.3",
            "resid.1"]
    _call_site_hooks(session, shape, acts, n_rows, [k for k in keys if not shape.family.missing(_kind(k))])
    if acts.device == "meta":  # the readout reads values out (.tolist()): none on meta
        return
    final = acts.make(n_rows, shape.d_model)
    session._on_final(None, (), final)
    session.read_pending()  # the rows kept for whole blocks
    if session.read_logits is not None:  # computed, not written: read back with the readout
        acts.unembedded = session.read_logits


def _call_site_hooks(session, shape, acts, n_rows, keys):
    """Each site key's hook called as vLLM calls it, with fresh activations; what it leaves kept."""
    import torch

    f, d = shape.family, shape.d_model
    for key in keys:
        site = _kind(key)
        width = shape.width(site)
        if site in ("resid_pre", "resid_mid"):
            index = (f.stream_arg or 0) if site == "resid_pre" else 0
            lead = [acts.make(n_rows, dtype=torch.long)] * index
            stream = [acts.make(n_rows, d)] + ([acts.make(n_rows, d)] if f.split_residual else [])
            args = tuple(lead + stream)
            new = session._make_stream_input_hook(key, index, f.split_residual)(None, args)
            acts.keep(*(new or args)[index:])
        elif site in ("q", "k", "v"):
            if site != "q":
                continue  # one hook per layer reads q, k and v
            qkv = (acts.make(n_rows, shape.width("q")), acts.make(n_rows, shape.width("k")),
                   acts.make(n_rows, shape.width("v")))
            new = session._make_attention_hook(int(key.split(".")[1]))(None, qkv)
            acts.keep(*(new or qkv))
        elif site in ("head", "neuron"):
            t = acts.make(n_rows, width)
            session._make_input_hook(key)(None, (t,))
            acts.keep(t)
        elif site == "resid" and f.split_residual:
            pair = (acts.make(n_rows, d), acts.make(n_rows, d))
            session._make_split_stream_hook(key)(None, (), pair)
            acts.keep(*pair)
        else:
            t = acts.make(n_rows, d)
            session._make_out_hook(key)(None, (), t)
            acts.keep(t)


# ---- the table ----
def device_line(device: str) -> str:
    import torch
    import transformers

    line = (f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}), transformers {transformers.__version__}"
            f", Python {platform.python_version()}")
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        line = (f"GPU {torch.cuda.get_device_name(0)} ({props.total_memory / 2**30:.0f} GiB, compute "
                f"{props.major}.{props.minor}), {torch.cuda.device_count()} visible; " + line)
    else:
        line = f"no GPU used (--device {device}: a dry run); " + line
    from patchgrid.runtime.machine import machine

    return f"{machine()}\n{line}"


def table(checks: list[Check]) -> str:
    rows = [("check", "device", "max abs diff", "tolerance", "result")]
    for c in checks:
        rows.append((c.name + (f" ({c.note})" if c.note else ""), c.device,
                     "-" if c.diff is None else f"{c.diff:.3g}", "-" if c.tol is None else f"{c.tol:.3g}",
                     "pass" if c.ok else "FAIL"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = [" | ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu", "meta"), default="cuda",
                        help="cuda (default); cpu: a dry run of every part; meta: the worker part alone")
    parser.add_argument("--models", default=",".join(MODELS), help="tiny models for the hf and attribution parts")
    parser.add_argument("--worker-models", default=",".join(WORKER_MODELS), help="tiny models for the worker part")
    args = parser.parse_args(argv)
    for option, allowed in (("models", MODELS), ("worker_models", WORKER_MODELS)):
        names = [n for n in getattr(args, option).split(",") if n]
        bad = [n for n in names if n not in allowed]
        if bad:
            parser.error(f"--{option.replace('_', '-')}: {bad[0]} is not one of {', '.join(allowed)}")
        setattr(args, option, names)
    return args


def run_checks(args) -> list[Check]:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32: no TF32 matmuls
    torch.backends.cudnn.allow_tf32 = False
    checks = []
    if args.device != "meta":
        for model in args.models:
            checks += guarded(f"hf {model}", args.device, hf_checks, model)
            checks += guarded(f"attribution {model}", args.device, attribution_checks, model)
    for model in args.worker_models:
        checks += guarded(f"worker {model}", args.device, worker_checks, model)
    return checks


def guarded(name: str, device: str, part, model: str) -> list[Check]:
    """A part's checks, or one failed check naming the error it stopped with (its traceback on stderr)."""
    try:
        return part(model, device)
    except Exception as exc:
        traceback.print_exc()
        first = str(exc).splitlines()[0] if str(exc) else ""
        return [Check(name, device, None, None, False, f"stopped: {type(exc).__name__}: {first}"[:160])]


def main(argv=None) -> int:
    args = _parse(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'});"
              " run it on a GPU machine, or pass --device cpu (or --device meta, the worker part) for a dry run",
              file=sys.stderr)
        return 2
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    print(device_line(args.device), flush=True)
    t0 = time.time()
    checks = run_checks(args)
    print(table(checks))
    failed = [c for c in checks if not c.ok]
    took = time.time() - t0
    print(f"{len(checks)} checks, {len(failed)} failed, in {took:.1f} s"
          + (f" (over the {BUDGET_S // 60} minutes it should take)" if took > BUDGET_S else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
