"""Cross-check against the field's own tools: the France/Germany resid grid three ways.

Denoising: the clean "The capital of France is" stream is patched into the corrupt "The capital
of Germany is" run at every layer x every position of smollm2-135m in float32, one patch per run;
the metric is the logit difference logit(" Paris") - logit(" Berlin") at the last position (what
`patchgrid patch --site resid` reports). Three ways, on the same token ids:

  patchgrid        the vLLM backend, float32 (the grid from `patchgrid patch`'s own code,
                   sweep_pair; the timing from one engine call holding all the patched runs, each
                   reading the two answers' logits, as the peers do, every layer computed); and
                   timed again as a study runs the same grid (run_sweeps, --metrics logit_diff):
                   each run started at its patched layer from the cached corrupt stream, and the
                   cells before the prompts' first difference read from the corrupt run, not run
  TransformerLens  TransformerBridge + patching.get_act_patch_resid_pre, one forward per patch
  nnsight          one trace, one tracer.invoke per patch, batched into one forward

and each engine's own floor, the same corrupt prompts run with no hook and no patching, timed in
turn with the tool that runs on it: vLLM's plain prefill (sweep_throughput.plain_prefill: no
patchgrid call computing every layer can be quicker), and the Hugging Face forward nnsight's invokes
batch into (the prompts as one batch, every position's logits, as nnsight's forward computes them).

Prints each tool's largest absolute difference from patchgrid's grid, and patched runs per second
measured in this run (a warm-up sweep, then the median of --repeats sweeps; the clean run that
supplies the patched values is outside the timing for all three), with the CPU and core count.

The peers never share patchgrid's virtual environment: on first use the script makes its own
(default ~/.cache/patchgrid/peers-venv, under PATCHGRID_HOME when set) and installs
benchmarks/peers-requirements.txt there (TransformerLens 4.3.0, nnsight 0.8.1, the CPU build of
torch 2.13.0); each peer then runs in that environment as `peers.py --peer NAME`, which imports
torch, transformers and the peer only, never patchgrid, and writes its grid and times as JSON.

Alignment: patchgrid's resid[L] is layer L's output, which is TransformerLens's resid_pre[L+1]
(and resid_post[29] for the last layer, past which no resid_pre exists) and nnsight's
model.layers[L].output. Every tool gets patchgrid's token ids: TransformerLens's own to_tokens
would prepend a BOS token (<|im_start|>) that patchgrid's tokenizer does not add.

    .venv/bin/python benchmarks/peers.py [--repeats 3] [--peers transformer_lens,nnsight]
        [--venv DIR] [--pip-args "--extra-index-url https://download.pytorch.org/whl/cpu"]

(--pip-args: where pip finds no torch==2.13.0+cpu by itself, point it at PyTorch's CPU index.)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

HERE = Path(__file__).resolve()
REQUIREMENTS = HERE.parent / "peers-requirements.txt"
PEERS = ("transformer_lens", "nnsight")
LABELS = {"patchgrid": "patchgrid (vLLM)", "transformer_lens": "TransformerLens", "nnsight": "nnsight"}
PAIR = {"clean": "The capital of France is", "corrupt": "The capital of Germany is",
        "clean_answer": " Paris", "corrupt_answer": " Berlin"}


def median_rate(n_runs: int, sweep, repeats: int) -> tuple[float, list[float]]:
    """Patched runs per second: one warm-up sweep, then the median of `repeats` timed sweeps."""
    return median_rates(n_runs, {"sweep": sweep}, repeats)["sweep"]


def median_rates(n_runs: int, sweeps: dict, repeats: int) -> dict:
    """median_rate of each of `sweeps` ({name: sweep}), timed in turn within each repeat (other
    work on shared cores slows each alike): {name: (runs per second, the timed sweeps' seconds)}."""
    for sweep in sweeps.values():
        sweep()
    times = {name: [] for name in sweeps}
    for _ in range(repeats):
        for name, sweep in sweeps.items():
            t0 = time.perf_counter()
            sweep()
            times[name].append(time.perf_counter() - t0)
    return {name: (n_runs / statistics.median(ts), ts) for name, ts in times.items()}


# ---------------------------------------------------------------------------------------------
# The peers' side: runs in the peers' environment; imports torch, transformers and one peer.

def peer_transformer_lens(spec: dict, repeats: int) -> dict:
    import pandas as pd
    import torch
    import transformer_lens.model_bridge.sources.transformers  # noqa: F401  (adds boot_transformers)
    from transformer_lens import patching
    from transformer_lens.model_bridge import TransformerBridge

    torch.set_grad_enabled(False)
    model = TransformerBridge.boot_transformers(spec["folder"], dtype=torch.float32, device="cpu")
    model.eval()
    clean = torch.tensor([spec["clean"]])
    corrupt = torch.tensor([spec["corrupt"]])
    a, b = spec["answers"]
    n_layers, n = model.cfg.n_layers, clean.shape[1]

    def metric(logits):
        return logits[0, -1, a] - logits[0, -1, b]

    _, clean_cache = model.run_with_cache(clean)
    # patchgrid resid[L] (layer L's output) = resid_pre[L+1]; the last layer's output is resid_post.
    pre_rows = pd.DataFrame([(layer + 1, pos) for layer in range(n_layers - 1) for pos in range(n)],
                            columns=["layer", "pos"])
    post_rows = pd.DataFrame([(n_layers - 1, pos) for pos in range(n)], columns=["layer", "pos"])
    out = {}

    def sweep():
        pre = patching.get_act_patch_resid_pre(model, corrupt, clean_cache, metric,
                                               index_axis_names=None, index_df=pre_rows)
        post = patching.generic_activation_patch(model, corrupt, clean_cache, metric,
                                                 patching.layer_pos_patch_setter, "resid_post",
                                                 index_df=post_rows)
        out["grid"] = torch.cat([pre, post]).reshape(n_layers, n)

    rate, times = median_rate(n_layers * n, sweep, repeats)
    clean_ld = float(metric(model(clean)))
    corrupt_ld = float(metric(model(corrupt)))
    own = model.to_tokens(spec["clean_text"])[0].tolist()
    own_no_bos = model.to_tokens(spec["clean_text"], prepend_bos=False)[0].tolist()
    return {"version": version("transformer-lens"),
            "grid": out["grid"].tolist(), "rate": rate, "times": times,
            "baseline": {"clean": clean_ld, "corrupt": corrupt_ld},
            "tokens": {"default": own, "prepend_bos=False": own_no_bos}}


def peer_nnsight(spec: dict, repeats: int) -> dict:
    import warnings

    import torch
    from nnsight import LanguageModel

    torch.set_grad_enabled(False)
    with warnings.catch_warnings():  # 0.8 calls LanguageModel deprecated; it still works and is documented
        warnings.simplefilter("ignore")
        model = LanguageModel(spec["folder"], dtype=torch.float32, device_map="cpu", dispatch=True)
    clean, corrupt = spec["clean"], spec["corrupt"]
    a, b = spec["answers"]
    n_layers, n = model.config.num_hidden_layers, len(clean)

    hidden = []
    with model.trace(clean):
        for layer in range(n_layers):
            hidden.append(model.model.layers[layer].output.save())
        clean_logits = model.lm_head.output[:, -1, [a, b]].save()
    with model.trace(corrupt):
        corrupt_logits = model.lm_head.output[:, -1, [a, b]].save()
    out = {}

    def sweep():
        saved = []
        with model.trace() as tracer:
            for layer in range(n_layers):
                for pos in range(n):
                    with tracer.invoke(corrupt):
                        model.model.layers[layer].output[:, pos] = hidden[layer][:, pos]
                        saved.append(model.lm_head.output[:, -1, [a, b]].save())
        out["grid"] = torch.stack([s[0, 0] - s[0, 1] for s in saved]).reshape(n_layers, n)

    # nnsight's floor: the forward its batched invokes run, once, without nnsight (the 150 corrupt
    # prompts as one batch through the same Hugging Face model, every position's logits computed)
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(spec["folder"], dtype=torch.float32,
                                                 attn_implementation=model.attn_implementation).eval()
    batch = torch.tensor([corrupt] * (n_layers * n))

    def forward():
        plain(input_ids=batch, use_cache=False)

    rates = median_rates(n_layers * n, {"sweep": sweep, "forward": forward}, repeats)
    (rate, times), (forward_rate, forward_times) = rates["sweep"], rates["forward"]
    return {"version": version("nnsight"), "grid": out["grid"].tolist(), "rate": rate, "times": times,
            "floor": {"rate": forward_rate, "times": forward_times},
            "baseline": {"clean": float(clean_logits[0, 0] - clean_logits[0, 1]),
                         "corrupt": float(corrupt_logits[0, 0] - corrupt_logits[0, 1])},
            "tokens": {"default": model.tokenizer(spec["clean_text"])["input_ids"]},
            "attn_implementation": model.attn_implementation}


def run_peer(args) -> int:
    import torch
    import transformers

    spec = json.loads(Path(args.spec).read_text())
    result = {"transformer_lens": peer_transformer_lens, "nnsight": peer_nnsight}[args.peer](spec, args.repeats)
    result.update(torch=torch.__version__, transformers=transformers.__version__, threads=torch.get_num_threads())
    Path(args.out).write_text(json.dumps(result))
    return 0


# ---------------------------------------------------------------------------------------------
# patchgrid's side: runs in patchgrid's environment.

def default_venv() -> Path:
    from patchgrid.model.models import cache_root

    return cache_root() / "peers-venv"


def ensure_venv(venv: Path, pip_args: list[str]) -> str:
    """Make the peers' environment, or bring it up to date with peers-requirements.txt."""
    python = venv / "bin" / "python"
    stamp = venv / ".peers-requirements.sha256"
    want = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()
    if python.exists() and stamp.exists() and stamp.read_text().strip() == want:
        return "ready"
    t0 = time.perf_counter()
    if not python.exists():
        # the interpreter patchgrid's venv was made from, not that venv itself
        base = getattr(sys, "_base_executable", None) or sys.executable
        subprocess.run([base, "-m", "venv", str(venv)], check=True)
    print(f"installing {REQUIREMENTS.name} into {venv} (once) ...", flush=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "-r", str(REQUIREMENTS), *pip_args], check=True)
    stamp.write_text(want + "\n")
    return f"installed in {time.perf_counter() - t0:.0f} s"


def patchgrid_grid(model: str, repeats: int) -> tuple[dict, dict]:
    """patchgrid's grid (via sweep_pair, the code of `patchgrid patch`) and its timing."""
    from transformers import AutoTokenizer

    from benchmarks.sweep_throughput import plain_prefill
    from patchgrid.backends.engine import load_engine
    from patchgrid.model.models import prepare
    from patchgrid.pipeline.one_pair import sweep_pair, tokenize_pair
    from patchgrid.plan import Patch, Request

    folder = prepare(model)
    pair = tokenize_pair(AutoTokenizer.from_pretrained(folder), **PAIR)
    engine = load_engine(model, "vllm", dtype="float32")
    try:
        n_layers, n = engine.shape.n_layers, len(pair.clean)
        out = sweep_pair(engine, pair, "resid")
        by = {(e["layer"], e["position"]): e["logit_diff"] for e in out["effects"]}
        grid = [[by[layer, pos] for pos in range(n)] for layer in range(n_layers)]

        answers = (pair.clean_answer, pair.corrupt_answer)
        keys = tuple(f"resid.{layer}" for layer in range(n_layers))
        sources = {"clean": engine.run([Request(tokens=pair.clean, answers=answers, capture=keys)])[0].captures}
        # reading what the peers read, the two answers' logits (a study's --metrics logit_diff; no rank
        # over the vocabulary), every layer computed as theirs are
        reqs = [Request(tokens=pair.corrupt, answers=answers, patches=(Patch("resid", layer, "clean", (pos,)),),
                        ranks=False) for layer in range(n_layers) for pos in range(n)]
        held = {}

        def sweep():
            held["results"] = engine.run(reqs, sources)

        prompts = [r.tokens for r in reqs]

        def plain():  # the engine's own floor: vLLM's prefill of the same prompts, no hook (sweep_throughput's)
            plain_prefill(engine, prompts, len(prompts))

        rates = median_rates(len(reqs), {"sweep": sweep, "plain": plain}, repeats)
        (rate, times), (floor_rate, floor_times) = rates["sweep"], rates["plain"]
        timed = [float(r.answer_logits[0] - r.answer_logits[1]) for r in held["results"]]
        study_rate, study_times, study_grid = as_a_study_runs_it(engine, pair, len(reqs), repeats)
        dtype = str(engine.dtype).removeprefix("torch.")
    finally:
        engine.close()
    # the timed call must compute the grid it is timed on
    timed_gap = max(abs(timed[layer * n + pos] - grid[layer][pos]) for layer in range(n_layers) for pos in range(n))
    spec = {"folder": str(folder), "clean": list(pair.clean), "corrupt": list(pair.corrupt),
            "answers": [pair.clean_answer, pair.corrupt_answer], "clean_text": PAIR["clean"],
            "strs": list(pair.clean_strs)}
    study_gap = max(abs(study_grid[layer][pos] - grid[layer][pos]) for layer in range(n_layers) for pos in range(n))
    return spec, {"grid": grid, "rate": rate, "times": times, "baseline": out["baseline"], "dtype": dtype,
                  "floor": {"rate": floor_rate, "times": floor_times},
                  "timed_gap": timed_gap, "study": {"rate": study_rate, "times": study_times, "gap": study_gap}}


def as_a_study_runs_it(engine, pair, n_runs: int, repeats: int) -> tuple[float, list[float], list[list[float]]]:
    """The same grid as a study (and `patchgrid patch`) computes it: run_sweeps over the resid kind,
    reading the logit difference alone (--metrics logit_diff), each patched run started at its layer
    from the cached corrupt stream and the cells before the prompts' first difference read from the
    corrupt run (they equal it: attention is causal). Patched runs per second of the whole grid
    (n_runs cells), the timed sweeps' seconds, and its grid."""
    from patchgrid.cache import MemoryStore
    from patchgrid.pipeline.one_pair import as_pair
    from patchgrid.sweeps import SweepConfig, cache_spec, run_sweeps

    p = as_pair(pair)
    config = SweepConfig(sweeps=("resid",), resid_directions=("denoise",), positions=tuple(range(len(pair.clean))),
                         metrics=("logit_diff",))
    store = MemoryStore(engine, [p], cache_spec(config, engine.shape.n_layers))  # outside the timing, as theirs
    held = {}

    def sweep():
        held["rows"] = run_sweeps(engine, [p], store, config)

    rate, times = median_rate(n_runs, sweep, repeats)
    by = {(r["layer"], r["position"]): r["patched_logit_diff"] for r in held["rows"]}
    n_layers = engine.shape.n_layers
    return rate, times, [[by[layer, pos] for pos in range(len(pair.clean))] for layer in range(n_layers)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=3, help="timed sweeps per tool, after one warm-up")
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--venv", type=Path, default=None, help="the peers' environment (made if missing)")
    parser.add_argument("--pip-args", default="", help="extra arguments for pip when installing the peers")
    parser.add_argument("--peer", choices=PEERS, help=argparse.SUPPRESS)  # internal: run one peer
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer:
        return run_peer(args)

    sys.path.insert(0, str(HERE.parents[1]))
    from patchgrid.runtime.machine import machine

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    peers = [p for p in args.peers.split(",") if p]
    for p in peers:
        if p not in PEERS:
            parser.error(f"unknown peer {p!r}; use {', '.join(PEERS)}")
    load_at_start = os.getloadavg()[0]
    venv = args.venv or default_venv()
    venv_state = ensure_venv(venv, args.pip_args.split()) if peers else "not used"

    spec, results = patchgrid_grid(args.model, args.repeats)
    results = {"patchgrid": results}
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TQDM_DISABLE="1",
               PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    with tempfile.TemporaryDirectory(prefix="patchgrid-peers-") as tmp:
        spec_file = Path(tmp) / "spec.json"
        spec_file.write_text(json.dumps(spec))
        for peer in peers:
            out = Path(tmp) / f"{peer}.json"
            log = Path(tmp) / f"{peer}.log"
            with open(log, "w") as f:
                rc = subprocess.run([str(venv / "bin" / "python"), str(HERE), "--peer", peer, "--spec", str(spec_file),
                                     "--out", str(out), "--repeats", str(args.repeats)],
                                    cwd=tmp, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
            if rc != 0:
                sys.stderr.write(log.read_text()[-4000:])
                print(f"{peer} failed (exit {rc}); its output's end is above", file=sys.stderr)
                return 1
            results[peer] = json.loads(out.read_text())

    ref = results["patchgrid"]
    n_layers, n = len(ref["grid"]), len(spec["clean"])
    print(f"{machine()}; 1-minute load average {load_at_start:.2f} before the run "
          "(other work on these cores slows every tool, the one-forward-per-patch loop most)")
    print(f"model {args.model}, float32: {n_layers} layers x {n} positions = {n_layers * n} patched runs per sweep "
          f"(resid, denoise); one warm-up sweep, then the median of {args.repeats}")
    print(f"tokens (all three tools): {spec['clean']} {spec['strs']}; corrupt {spec['corrupt']}; "
          f"answers {spec['answers']}")
    p = results.get("transformer_lens")
    if p:
        print(f"TransformerLens's own to_tokens: {p['tokens']['default']} (prepends BOS); with prepend_bos=False: "
              f"{p['tokens']['prepend_bos=False']}")
    p = results.get("nnsight")
    if p:
        print(f"nnsight's tokenizer: {p['tokens']['default']}")
    print(f"peers' environment: {venv} ({venv_state}); "
          + ", ".join(f"{LABELS[k]} {results[k]['version']}" for k in peers)
          + (f", torch {results[peers[0]]['torch']}, transformers {results[peers[0]]['transformers']}"
             if peers else ""))
    print(f"patchgrid's timed engine call vs its sweep_pair grid: largest difference {ref['timed_gap']:.1e}")
    print()
    print(f"{'tool':<18} {'clean LD':>9} {'corrupt LD':>11} {'max |diff| vs patchgrid':>24} "
          f"{'patched runs/s':>15} {'patchgrid / tool':>17}  sweep seconds")
    for name in ("patchgrid", *peers):
        r = results[name]
        gap = max(abs(r["grid"][layer][pos] - ref["grid"][layer][pos]) for layer in range(n_layers) for pos in range(n))
        ratio = ref["rate"] / r["rate"]
        print(f"{LABELS[name]:<18} {r['baseline']['clean']:>+9.4f} {r['baseline']['corrupt']:>+11.4f} "
              f"{('' if name == 'patchgrid' else f'{gap:.1e}'):>24} {r['rate']:>15.1f} "
              f"{('' if name == 'patchgrid' else f'{ratio:.2f}x'):>17}  "
              + " ".join(f"{t:.2f}" for t in r["times"]))
    st = ref["study"]
    print(f"{'patchgrid, as a study runs it':<30} {st['rate']:>15.1f} runs/s (started mid-stack, cells before the "
          f"first difference read from the corrupt run; grid within {st['gap']:.1e} of the above): "
          + ", ".join(f"{st['rate'] / results[k]['rate']:.2f}x {LABELS[k]}" for k in peers)
          + "  sweep seconds " + " ".join(f"{t:.2f}" for t in st["times"]))
    floor = ref["floor"]
    print(f"{'vLLM, plain prefill':<30} {floor['rate']:>15.1f} runs/s (the same {n_layers * n} corrupt prompts, "
          f"no hook: the engine's own floor for every layer computed); patchgrid's engine call / it "
          f"{ref['rate'] / floor['rate']:.2f}; it / "
          + ", ".join(f"{LABELS[k]} {floor['rate'] / results[k]['rate']:.2f}x" for k in peers)
          + "  sweep seconds " + " ".join(f"{t:.2f}" for t in floor["times"]))
    if "nnsight" in results:
        hf = results["nnsight"]["floor"]
        print(f"{'Hugging Face, one forward':<30} {hf['rate']:>15.1f} runs/s (the same prompts as one batch, every "
              f"position's logits, no hook: the forward nnsight's invokes run); nnsight / it "
              f"{results['nnsight']['rate'] / hf['rate']:.2f}; vLLM's plain prefill / it "
              f"{floor['rate'] / hf['rate']:.2f}"
              "  sweep seconds " + " ".join(f"{t:.2f}" for t in hf["times"]))
    worst = max((max(abs(results[k]["grid"][layer][pos] - ref["grid"][layer][pos])
                     for layer in range(n_layers) for pos in range(n)) for k in peers), default=0.0)
    print()
    print(f"all grids agree within {worst:.1e} (logit difference units; the grid spans "
          f"{min(map(min, ref['grid'])):+.3f} to {max(map(max, ref['grid'])):+.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
