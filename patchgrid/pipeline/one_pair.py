"""Patch one clean/corrupt pair typed at the command line at every layer (and head) and position.

LD (logit difference) = logit(clean answer) - logit(corrupt answer) at the last position. An answer
is tokenised as a data set's is (pairs.align.answer_tokens: after a space when the prompt does not end
in one) and may be several tokens: it is then scored whole after the prompt (patchgrid.metrics).
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import metrics
from ..cache import MemoryStore
from ..metrics import METRICS
from ..model.sites import PATCHABLE
from ..pairs.align import Answer, Rejection, answer_tokens, check_follows, position_roles
from ..pairs.pair import Pair
from ..sweeps import SweepConfig, cache_spec, kind_for_site, run_sweeps


class PairError(ValueError):
    """A pair that cannot be patched position by position; the message says why."""


@dataclass(frozen=True)
class PairTokens:
    clean: tuple[int, ...]
    corrupt: tuple[int, ...]
    clean_answer_ids: tuple[int, ...]  # every token of the answer, scored after the prompt
    corrupt_answer_ids: tuple[int, ...]
    clean_strs: tuple[str, ...] = ()

    @property
    def clean_answer(self) -> int:
        """The clean answer's first token (the logit difference reads it)."""
        return self.clean_answer_ids[0]

    @property
    def corrupt_answer(self) -> int:
        return self.corrupt_answer_ids[0]


def _answer(tokenizer, prompt: str, prompt_ids: tuple[int, ...], answer: str, flag: str, which: str):
    """An answer typed at the command line, by the data sets' rule (answer_tokens), checked to be
    what follows the prompt's tokens as a data set's answer is (check_follows)."""
    text, ids = answer_tokens(tokenizer, prompt, answer)
    if not ids:
        raise PairError(f"{flag} {answer!r} is empty")
    try:
        check_follows(tokenizer, prompt, prompt_ids, Answer(text, ids, ids, "full" if len(ids) > 1 else "single"),
                      which)
    except Rejection as exc:
        raise PairError(f"{flag} {answer!r}: {exc.detail}") from exc
    return ids


def split_answers(tokenizer, tokens: PairTokens, clean_answer: str, corrupt_answer: str) -> list[str]:
    """A line for each answer that is several tokens: its tokens, and how it is scored."""
    lines = []
    for flag, answer, ids in (("--clean-answer", clean_answer, tokens.clean_answer_ids),
                              ("--corrupt-answer", corrupt_answer, tokens.corrupt_answer_ids)):
        if len(ids) > 1:
            lines.append(f"{flag} {answer!r} is {len(ids)} tokens {[tokenizer.decode([t]) for t in ids]}: scored "
                         "whole after the prompt (teacher-forced), on the log-probability difference (logprob_diff) "
                         "rather than the logit difference of one token")
    return lines


def tokenize_pair(tokenizer, clean: str, corrupt: str, clean_answer: str, corrupt_answer: str) -> PairTokens:
    c = tuple(tokenizer(clean)["input_ids"])
    k = tuple(tokenizer(corrupt)["input_ids"])
    if not c:
        raise PairError("--clean is empty")
    if len(c) != len(k):
        raise PairError(f"--clean and --corrupt tokenize to different lengths ({len(c)} vs {len(k)} tokens), "
                        "so positions do not line up")
    a = _answer(tokenizer, clean, c, clean_answer, "--clean-answer", "clean")
    b = _answer(tokenizer, corrupt, k, corrupt_answer, "--corrupt-answer", "corrupt")
    if a == b:
        shown = [tokenizer.decode([t]) for t in a]
        raise PairError(f"--clean-answer {clean_answer!r} and --corrupt-answer {corrupt_answer!r} are the same "
                        f"tokens {shown}")
    return PairTokens(c, k, a, b, tuple(tokenizer.decode([t]) for t in c))


def as_pair(tokens: PairTokens, pair_id: str = "pair") -> Pair:
    """A pair typed at the command line as the sweeps take it; its subject is where the prompts differ."""
    diff = [i for i, (a, b) in enumerate(zip(tokens.clean, tokens.corrupt)) if a != b]
    start, end = (diff[0], diff[-1] + 1) if diff else (0, 0)
    return Pair(pair_id, None, tokens.clean, tokens.corrupt, tokens.clean_answer_ids, tokens.corrupt_answer_ids,
                start, end, tuple(position_roles(len(tokens.clean), start, end)))


def sweep_pair(engine, tokens: PairTokens, site: str, positions: list[int] | None = None) -> dict:
    """Denoise: patch clean into corrupt at each (layer[, head], position) separately, through the
    same sweep code as a study (the sweep kind that patches `site` alone)."""
    if site not in PATCHABLE:
        raise PairError(f"--site {site!r} is unknown or cannot be patched; use one of {', '.join(PATCHABLE)}")
    why = engine.shape.family.missing(site)
    if why:
        raise PairError(f"--site {site}: {why}")
    n = len(tokens.clean)
    for p in positions or ():
        if not 0 <= p < n:
            raise PairError(f"--position {p} is out of range (the prompts have {n} tokens)")
    pair = as_pair(tokens)
    config = SweepConfig(sweeps=(kind_for_site(site).name,), resid_directions=("denoise",),
                         positions=tuple(range(n)) if positions is None else tuple(positions))
    store = MemoryStore(engine, [pair], cache_spec(config, engine.shape.n_layers))
    rows = [r for r in run_sweeps(engine, [pair], store, config) if r["site"] == site]  # qkv: q, k and v
    base = store.baselines[pair.pair_id]
    metric = rows[0]["metric"] if rows else "logit_diff"  # logprob_diff when an answer has several tokens
    return {
        "baseline": {"metric": metric, "clean": base[f"clean_{metric}"], "corrupt": base[f"corrupt_{metric}"],
                     "runs": {run: {m: base[f"{run}_{m}"] for m in METRICS} for run in ("clean", "corrupt")}},
        "effects": [{"site": r["site"], "layer": r["layer"], "position": r["position"], "head": r["head"],
                     "neuron": r["neuron"], **{m: r[f"patched_{m}"] for m in METRICS}, "recovery": r["recovery"]}
                    for r in rows],
    }


def paths_pair(engine, tokens: PairTokens, senders, receivers, inputs=("q", "k", "v"), mlps: str = "frozen",
               positions: list[int] | None = None) -> dict:
    """Path patching on one pair (sweeps.paths), denoising: each sender's clean output on the path to
    each receiver only. Positions: the given ones one by one, or (None) every position at once and
    the subject's last token and the last token."""
    n = len(tokens.clean)
    for p in positions or ():
        if not 0 <= p < n:
            raise PairError(f"--position {p} is out of range (the prompts have {n} tokens)")
    pair = as_pair(tokens)
    try:
        config = SweepConfig(sweeps=("paths",), path_senders=tuple(senders), path_receivers=tuple(receivers),
                             path_inputs=tuple(inputs), path_mlps=mlps,
                             positions=None if positions is None else tuple(positions))
    except ValueError as exc:
        raise PairError(str(exc)) from None
    store = MemoryStore(engine, [pair], cache_spec(config, engine.shape.n_layers))
    try:
        rows = run_sweeps(engine, [pair], store, config)
    except ValueError as exc:  # an end outside the model
        raise PairError(str(exc)) from None
    base = store.baselines[pair.pair_id]
    metric = rows[0]["metric"] if rows else "logit_diff"
    return {
        "baseline": {"metric": metric, "clean": base[f"clean_{metric}"], "corrupt": base[f"corrupt_{metric}"]},
        "mlps": mlps,
        "effects": [{"sender": r["sender"], "receiver": r["receiver"], "position": r["position"],
                     "effect": r["effect"], "recovery": r["recovery"], **{m: r[f"patched_{m}"] for m in METRICS}}
                    for r in rows],
    }


def recovery(value: float, baseline: dict) -> float | None:
    """Recovery of a patched value on sweep_pair's headline metric against its baseline
    (metrics.recovery)."""
    return metrics.recovery(value, baseline["clean"], baseline["corrupt"])
