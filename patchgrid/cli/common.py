"""What the commands share: the usage error, positions from the command line, a model's tokenizer."""
from __future__ import annotations


class UsageError(Exception):
    pass


def parse_positions(text: str | None):
    if text is None or text == "all":
        return None
    try:
        return [int(p) for p in text.split(",")]
    except ValueError:
        raise UsageError(f"--position {text!r} is not a position number, a comma list, or 'all'") from None


def tokenizer_of(model: str):
    from ..model.models import prepare

    folder = prepare(model)  # an unknown model is refused before transformers' import (seconds)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
