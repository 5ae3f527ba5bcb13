"""What a patched run is measured by, and how an effect is turned into a recovery.

Every run reads a `Reading` at the last position: the logit difference
logit(clean answer) - logit(corrupt answer), and the clean answer's probability. An effect row
names the metric its `effect` and `recovery` are computed on. To add a metric: a field of
`Reading`, filled in `Reading.of`, its entries in `METRICS` and `MIN_SPAN`, and its
patched/clean/corrupt columns in `rows.EFFECT`.
"""
from __future__ import annotations

from dataclasses import dataclass

METRICS = {
    "logit_diff": "logit(clean answer) - logit(corrupt answer) at the last position",
    "p": "probability of the clean answer at the last position",
}

# A recovery divides by the span clean - corrupt. Where the span is smaller than this (or
# negative, which --no-require-known allows), the ratio is noise: the pair is left out of the
# recovery averages (and counted there as n_small_span); its effect is still averaged.
MIN_SPAN = {
    "logit_diff": 0.5,  # logits
    "p": 0.02,  # probability
}


@dataclass(frozen=True)
class Reading:
    logit_diff: float
    p: float

    @classmethod
    def of(cls, result) -> Reading:
        """From an engine Result whose answers are (clean answer, corrupt answer)."""
        return cls(float(result.answer_logits[0] - result.answer_logits[1]), float(result.answer_probs[0]))

    def value(self, metric: str) -> float:
        return getattr(self, metric)


def recovery(patched: float, clean: float, corrupt: float) -> float | None:
    """(patched - corrupt) / (clean - corrupt): 1 when the patch restores the clean value, 0 when it
    does nothing; None when clean and corrupt are equal and the ratio is undefined."""
    span = clean - corrupt
    return None if span == 0 else (patched - corrupt) / span
