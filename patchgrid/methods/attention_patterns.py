"""One text's attention patterns read on an engine (`patchgrid attention`): per layer and head asked,
each query position's weights over the key positions, as the model's attention computes them (the
`pattern` site: on vLLM from the q and k its kernel receives, backends.patterns; on hf where
transformers computes attention)."""
from __future__ import annotations

from ..model.sites import site_key
from ..plan import Request


def check_units(what: str, asked, count: int) -> list[int]:
    """The layers (heads) asked, every one when none; one the model lacks is refused, naming the flag."""
    if asked is None:
        return list(range(count))
    past = [u for u in asked if u >= count]
    if past:
        raise ValueError(f"--{what} {past[0]}: the model has {count} {what} (0-{count - 1})")
    return list(asked)


def read_patterns(engine, token_ids, layers=None, heads=None) -> list[dict]:
    """[{"layer", "head", "weights": [[query rows] x [key columns]]}] for the layers and heads asked
    (default: every one), in layer then head order."""
    shape = engine.shape
    layers = check_units("layers", layers, shape.n_layers)
    heads = check_units("heads", heads, shape.n_heads)
    keys = tuple(site_key("pattern", layer) for layer in layers)
    got = engine.run([Request(tokens=tuple(token_ids), capture=keys)])[0]
    n = len(token_ids)
    out = []
    for layer, key in zip(layers, keys):
        per_head = got.captures[key].float().view(n, shape.n_heads, n)
        out += [{"layer": layer, "head": h, "weights": per_head[:, h].tolist()} for h in heads]
    return out


def strongest_reads(patterns: list[dict], tokens: list[str], top: int = 3) -> list[tuple]:
    """Per layer and head, the key positions the last query position reads most: (layer, head,
    [(position, token, weight)])."""
    rows = []
    for p in patterns:
        last = p["weights"][-1]
        best = sorted(range(len(last)), key=lambda s: -last[s])[:top]
        rows.append((p["layer"], p["head"], [(s, tokens[s], last[s]) for s in best]))
    return rows
