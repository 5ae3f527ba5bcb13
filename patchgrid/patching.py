"""Patch one clean/corrupt pair at every layer (and head) and position, in one engine call.

LD (logit difference) = logit(clean answer) - logit(corrupt answer) at the last position.
"""
from __future__ import annotations

from dataclasses import dataclass

from .plan import Patch, Request
from .sites import SITE_KINDS, site_key


class PairError(ValueError):
    """A pair that cannot be patched position by position; the message says why."""


@dataclass(frozen=True)
class PairTokens:
    clean: tuple[int, ...]
    corrupt: tuple[int, ...]
    clean_answer: int
    corrupt_answer: int
    clean_strs: tuple[str, ...] = ()


def answer_token(tokenizer, text: str, field: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        shown = [tokenizer.decode([i]) for i in ids]
        raise PairError(f"{field} {text!r} is {len(ids)} tokens {shown}, not one")
    return ids[0]


def tokenize_pair(tokenizer, clean: str, corrupt: str, clean_answer: str, corrupt_answer: str) -> PairTokens:
    c = tuple(tokenizer(clean)["input_ids"])
    k = tuple(tokenizer(corrupt)["input_ids"])
    if not c:
        raise PairError("--clean is empty")
    if len(c) != len(k):
        raise PairError(f"--clean and --corrupt tokenize to different lengths ({len(c)} vs {len(k)} tokens), "
                        "so positions do not line up")
    a = answer_token(tokenizer, clean_answer, "--clean-answer")
    b = answer_token(tokenizer, corrupt_answer, "--corrupt-answer")
    if a == b:
        raise PairError("--clean-answer and --corrupt-answer are the same token")
    return PairTokens(c, k, a, b, tuple(tokenizer.decode([t]) for t in c))


def sweep_pair(engine, pair: PairTokens, site: str, positions: list[int] | None = None) -> dict:
    """Denoise: patch clean into corrupt at each (layer[, head], position) separately."""
    if site not in SITE_KINDS:
        raise PairError(f"--site {site!r} is unknown; use one of {', '.join(SITE_KINDS)}")
    shape = engine.shape
    n = len(pair.clean)
    positions = list(range(n)) if positions is None else positions
    for p in positions:
        if not 0 <= p < n:
            raise PairError(f"--position {p} is out of range (the prompts have {n} tokens)")
    answers = (pair.clean_answer, pair.corrupt_answer)
    layers = [None] if site == "embed" else list(range(shape.n_layers))
    heads = list(range(shape.n_heads)) if site == "head" else [None]
    keys = tuple(site_key(site, layer) for layer in layers)
    grid = [(layer, head, pos) for layer in layers for head in heads for pos in positions]

    clean_run, corrupt_run = engine.run([
        Request(tokens=pair.clean, answers=answers, capture=keys),
        Request(tokens=pair.corrupt, answers=answers),
    ])
    sources = {"clean": clean_run.captures}
    patched = engine.run(
        [Request(tokens=pair.corrupt, answers=answers,
                 patches=(Patch(site, layer, "clean", (pos,), head),)) for layer, head, pos in grid],
        sources,
    )

    def ld(r):
        return float(r.answer_logits[0] - r.answer_logits[1])

    effects = [
        {"site": site, "layer": layer, "position": pos, "head": head,
         "logit_diff": ld(r), "p_clean_answer": float(r.answer_probs[0])}
        for (layer, head, pos), r in zip(grid, patched)
    ]
    return {"baseline": {"clean": ld(clean_run), "corrupt": ld(corrupt_run)}, "effects": effects}


def recovery(ld: float, baseline: dict) -> float:
    span = baseline["clean"] - baseline["corrupt"]
    return float("nan") if span == 0 else (ld - baseline["corrupt"]) / span
