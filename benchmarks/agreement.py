"""How far an engine figure's numbers are from a Hugging Face float32 reference, judged as nnbench
(ndif-team/nnbench) judges interpretability engines; the line each speed benchmark prints beside its
figures.

For the engine as a figure ran it (its backend, dtype, and whether patched runs start mid-stack), a
sample of patched runs is run on that engine and on the `hf` backend in float32 (every layer, the
same requests, each engine patching in values from its own clean run): per pair (the first
`PAIRS` of the benchmark's), the clean and corrupt runs, and at `LAYERS` layers spread over the
model a resid patch at the first position where the prompts differ and at the last, attn_out at
the last, mlp_out at the first differing one, and one head at the last (22 runs per pair). Each run
reads its answers whole (patchgrid.metrics.Reading) and its next-token log-probabilities at the last
prompt position. Three measures over the sample:

  top-1   the share of runs whose most likely next token is the reference's
  TV      the largest total-variation distance, 0.5 * sum |p - q|, between the run's next-token
          distribution and the reference's
  metric  the largest difference of any metric value (logit_diff, logprob_diff, logp_clean,
          logp_corrupt, p, kl: logits, nats or a probability; rank is left out, being a count that
          near-ties move)

Labels (nnbench's vocabulary):

  supported  within float32 tolerance: top-1 1 (every run), TV <= 1e-3 and metric <= 1e-3 (two float32
             engines on smollm2-135m differ by about 1e-4: float32 roundings in another order)
  degraded   not supported, but only a bf16-sized difference remains (top-1 >= 0.9, TV <= 0.1,
             metric <= 1.0: the bf16 layers' roundings of the stream, 2^-8 of it at each layer; on
             smollm2-135m in bf16 both vLLM's kernels and transformers' own measured TV max 0.057-0.065
             and metric 0.30-0.36 on this sample) AND a float32 rerun of the same engine (same backend
             and starts, dtype float32) is supported
  wrong      anything else (nnbench's "silently wrong": e.g. a logit lens reading one of vLLM's two
             residual halves has top-1 0.13)

    from benchmarks.agreement import Judge
    judge = Judge("smollm2-135m", pairs)   # pairs: (clean ids, corrupt ids, clean answer ids, corrupt answer ids)
    print(judge.line(engine, started=True))
    judge.close()
"""
from __future__ import annotations

from dataclasses import dataclass, replace

PAIRS = 4  # pairs of the benchmark's sampled
LAYERS = 4  # layers per pair, spread from the first to the last
# float32 tolerance (supported) and a bf16-sized difference (degraded); see the docstring
F32 = {"top1": 1.0, "tv": 1e-3, "metric": 1e-3}
BF16 = {"top1": 0.9, "tv": 0.1, "metric": 1.0}
METRICS = ("logit_diff", "logprob_diff", "logp_clean", "logp_corrupt", "p", "kl")


@dataclass(frozen=True)
class Agreement:
    runs: int
    top1: float
    tv: float
    metric: float
    worst_metric: str

    def within(self, bounds: dict) -> bool:
        return self.top1 >= bounds["top1"] and self.tv <= bounds["tv"] and self.metric <= bounds["metric"]

    def text(self) -> str:
        return (f"top-1 {self.top1:.3f}, TV max {self.tv:.2e}, largest metric difference {self.metric:.2e} "
                f"({self.worst_metric})")


def _spread(n: int, k: int) -> list[int]:
    return sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(k)})


def _run(tokens, clean_ans, corrupt_ans, reference: str):
    """An unpatched run of `tokens` reading both answers whole and its next-token log-probabilities."""
    from patchgrid.plan import Request

    return Request(tokens=tuple(tokens), answers=(clean_ans[0], corrupt_ans[0]),
                   continuations=(tuple(clean_ans), tuple(corrupt_ans)), logprobs=True, reference=reference)


def sample_requests(engine, pairs, started: bool):
    """The sampled runs' requests and the sources they read, from `engine`'s own clean and corrupt runs."""
    from patchgrid.cache import stream_keys
    from patchgrid.plan import LOGPROBS, Patch, Start, latest_start

    shape = engine.shape
    layers = _spread(shape.n_layers, LAYERS)
    keys = tuple(f"{site}.{layer}" for layer in layers for site in ("resid", "attn_out", "mlp_out", "head"))
    reqs, sources = [], {}
    for i, (clean, corrupt, clean_ans, corrupt_ans) in enumerate(pairs[:PAIRS]):
        src = f"{i}:clean"
        clean_run, corrupt_run = _run(clean, clean_ans, corrupt_ans, src), _run(corrupt, clean_ans, corrupt_ans, src)
        c, x = engine.run([replace(clean_run, capture=keys, reference=None),
                           replace(corrupt_run, capture=stream_keys(shape.n_layers), reference=None)])
        sources[src] = {**c.captures, LOGPROBS: c.logprobs}
        sources[f"{i}:corrupt"] = x.captures
        diff = next((p for p, (a, b) in enumerate(zip(clean, corrupt)) if a != b), 0)
        last = len(corrupt) - 1
        reqs += [clean_run, corrupt_run]
        for layer in layers:
            for p in (Patch("resid", layer, src, (diff,)), Patch("resid", layer, src, (last,)),
                      Patch("attn_out", layer, src, (last,)), Patch("mlp_out", layer, src, (diff,)),
                      Patch("head", layer, src, (last,), layer % shape.n_heads)):
                r = replace(corrupt_run, patches=(p,))
                start = latest_start(r.patches, shape.n_layers) if started else 0
                reqs.append(replace(r, start=Start(start, f"{i}:corrupt")) if start else r)
    return reqs, sources


def compare(results, reference) -> Agreement:
    """The three measures of `results` against `reference` (the same requests' results)."""
    import torch

    from patchgrid.metrics import Reading

    top1, tv, worst, name = 0, 0.0, 0.0, METRICS[0]
    for got, ref in zip(results, reference, strict=True):
        top1 += int(torch.argmax(got.logprobs) == torch.argmax(ref.logprobs))
        tv = max(tv, 0.5 * float((got.logprobs.exp() - ref.logprobs.exp()).abs().sum()))
        a, b = Reading.of(got), Reading.of(ref)
        for m in METRICS:
            va, vb = a.value(m), b.value(m)
            if va is not None and vb is not None and abs(va - vb) > worst:
                worst, name = abs(va - vb), m
    return Agreement(len(results), top1 / len(results), tv, worst, name)


class Judge:
    """The reference (hf, float32) of one model, run once per set of pairs; each engine figure judged
    against it, with a float32 rerun of the engine where its own dtype leaves a difference (the rerun
    engine is kept until `close`, for the figures after). `pairs`: the benchmark's, or a figure's own."""

    def __init__(self, model: str, pairs=()):
        self.model, self.pairs = model, list(pairs)
        self._references, self._reruns, self._engines = {}, {}, {}

    def _key(self, pairs) -> tuple:
        return tuple((tuple(a), tuple(b), tuple(c), tuple(d)) for a, b, c, d in (pairs or self.pairs)[:PAIRS])

    def _engine(self, backend: str):
        if backend not in self._engines:
            from patchgrid.backends.engine import load_engine

            self._engines[backend] = load_engine(self.model, backend, dtype="float32")
        return self._engines[backend]

    def reference(self, pairs=None):
        key = self._key(pairs)
        if key not in self._references:
            ref = self._engine("hf")
            self._references[key] = ref.run(*sample_requests(ref, key, started=False))
        return self._references[key]

    def measure(self, engine, started: bool, pairs=None) -> Agreement:
        reqs, sources = sample_requests(engine, self._key(pairs), started)
        return compare(engine.run(reqs, sources), self.reference(pairs))

    def float32_rerun(self, backend: str, started: bool, pairs=None) -> Agreement:
        key = (backend, started, self._key(pairs))
        if key not in self._reruns:
            self._reruns[key] = self.measure(self._engine(backend), started and backend == "vllm", pairs)
        return self._reruns[key]

    def label(self, engine, started: bool, pairs=None) -> tuple[str, Agreement, Agreement | None]:
        """(label, the engine's agreement, its float32 rerun's where one was needed)."""
        got = self.measure(engine, started, pairs)
        if got.within(F32):
            return "supported", got, None
        if not got.within(BF16) or str(engine.dtype) == "torch.float32":
            return "wrong", got, None
        rerun = self.float32_rerun(engine.name, started, pairs)
        return ("degraded" if rerun.within(F32) else "wrong"), got, rerun

    def line(self, engine, started: bool, pairs=None) -> str:
        """The figure's agreement line: the measures, the label, the float32 rerun's measures."""
        label, got, rerun = self.label(engine, started, pairs)
        dtype = str(engine.dtype).removeprefix("torch.")
        text = (f"  agreement with hf float32 ({engine.name} {dtype}, {got.runs} runs of {len(self._key(pairs))} "
                f"pairs): {got.text()}: {label}")
        if rerun is not None:
            text += f"\n    float32 rerun: {rerun.text()}"
        return text

    def close(self) -> None:
        for engine in self._engines.values():
            engine.close()
        self._engines = {}
