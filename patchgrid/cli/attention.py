"""`patchgrid attention`: one text's attention patterns."""
from __future__ import annotations

import json

from .common import UsageError, tokenizer_of


def cmd_attention(args) -> int:
    from ..backends.engine import load_engine
    from ..methods.attention_patterns import check_units, read_patterns, strongest_reads
    from ..settings import number_list

    tokenizer = tokenizer_of(args.model)
    ids = tokenizer(args.text, add_special_tokens=True)["input_ids"]
    if not ids:
        raise UsageError("--text: it has no tokens")
    try:
        layers = None if args.layers is None else number_list(args.layers)
        heads = None if args.heads is None else number_list(args.heads)
    except ValueError as exc:
        raise UsageError(str(exc).format(name="--layers or --heads")) from None
    engine = load_engine(args.model, args.backend, dtype=args.dtype)
    try:
        try:  # checked against the model before anything runs
            check_units("layers", layers, engine.shape.n_layers)
            check_units("heads", heads, engine.shape.n_heads)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        patterns = read_patterns(engine, ids, layers, heads)
    finally:
        engine.close()
    tokens = tokenizer.convert_ids_to_tokens(ids)
    if args.json:
        print(json.dumps({"tokens": tokens, "patterns": patterns}))
        return 0
    print(f"{len(tokens)} tokens: {' '.join(tokens)}")
    print("layer  head  what the last position reads most (position token weight)")
    for layer, head, reads in strongest_reads(patterns, tokens, args.top):
        print(f"{layer:5d}  {head:4d}  " + ", ".join(f"{s} {t!r} {w:.3f}" for s, t, w in reads))
    return 0
