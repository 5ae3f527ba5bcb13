"""`validate`: every request that cannot run as asked is refused before anything runs, with a
message that names the field."""
from __future__ import annotations

from ..model.sites import LAYER_SITES, SITE_KINDS, SITES, ModelShape, parse_key
from .forwards import tree_len
from .request import LOGPROBS, Patch, Request


class PlanError(ValueError):
    """A request that cannot run as asked; the message names the field."""


def validate(requests, sources, shape: ModelShape) -> None:
    """Refuse any out-of-range plan before anything runs. A grid's requests share their tokens,
    answers, references and patches' shapes (a pair's every cell): what passed once in this call is
    not checked again (`passed`, keyed by the values checked, so a request that fails is always
    named: its first failing check is the one made)."""
    passed: set = set()
    source_rows: dict = {}
    for i, req in enumerate(requests):
        where = f"request {i}"
        if _unchecked(passed, (req.tokens, req.answers, req.continuations, req.top_k)):
            _check_tokens(where, req, shape)
            _check_continuations(where, req, shape)
        if _unchecked(passed, ("reference", req.reference)):
            _check_reference(where, req, sources, shape)
        if req.capture:
            _check_captures(where, req, shape)
        for p in req.patches:
            _check_patch(where, p, req, sources, shape, passed, source_rows)
        if req.noise:
            _check_noise(where, req)
        if req.knockout is not None:
            _check_knockout(where, req, shape)
        if req.start is not None:
            if _unchecked(passed, ("start", req.start.layer, req.start.source, len(req.tokens), req.continuations)):
                _check_start_source(where, req, sources, shape)
            _check_start_skips_nothing(where, req)


def _unchecked(passed: set, key: tuple) -> bool:
    """Whether the checks `key` names are still to be made in this call (and, from now, marked made:
    a check that fails raises, which ends the call's checks). A key holding a list (a request built
    by hand may give its tokens as one) is checked every time."""
    try:
        if key in passed:
            return False
        passed.add(key)
    except TypeError:
        pass
    return True


def _check_tokens(where, req: Request, shape: ModelShape) -> None:
    n = len(req.tokens)
    if n == 0:
        raise PlanError(f"{where}: tokens is empty")
    if n > shape.max_len:
        raise PlanError(f"{where}: tokens has {n} tokens, more than the model's {shape.max_len}")
    _check_ids(where, "token", req.tokens, shape)
    _check_ids(where, "answer", req.answers, shape)
    if req.top_k < 0:
        raise PlanError(f"{where}: top_k {req.top_k} is negative")


def _check_ids(where, what: str, ids, shape: ModelShape) -> None:
    if not ids or (0 <= min(ids) and max(ids) < shape.vocab_size):
        return
    for t in ids:
        if not 0 <= int(t) < shape.vocab_size:
            raise PlanError(f"{where}: {what} id {t} is outside the vocabulary (0..{shape.vocab_size - 1})")


def _check_continuations(where, req: Request, shape: ModelShape) -> None:
    n = len(req.tokens)
    for j, c in enumerate(req.continuations):
        if not c:
            raise PlanError(f"{where}: continuation {j} is empty")
        _check_ids(where, f"continuation {j} token", c, shape)
        if n + len(c) - 1 > shape.max_len:
            raise PlanError(f"{where}: continuation {j} has {len(c)} tokens; after the {n}-token prompt that "
                            f"is more than the model's {shape.max_len}")


def _check_reference(where, req: Request, sources, shape: ModelShape) -> None:
    if req.reference is None:
        return
    ref = sources.get(req.reference, {}).get(LOGPROBS)
    if ref is None:
        raise PlanError(f"{where}: reference source {req.reference!r} holds no {LOGPROBS}")
    if ref.dim() != 1 or ref.shape[0] != shape.vocab_size:
        raise PlanError(f"{where}: reference {req.reference!r} {LOGPROBS} has shape {tuple(ref.shape)}, "
                        f"expected [{shape.vocab_size}]")


def _check_captures(where, req: Request, shape: ModelShape) -> None:
    for key in req.capture:
        try:
            site, layer = parse_key(key)
        except ValueError as exc:
            raise PlanError(f"{where}: capture {exc}") from None
        _check_layer(where, "capture", layer, shape)
        _check_family(where, site, shape)
        if site == "pattern" and tree_len(req) != len(req.tokens):
            raise PlanError(f"{where}: capture {key}: a pattern is read over one forward, and this request's "
                            "answers of several tokens are scored over several; capture it on a request without them")


def _check_noise(where, req: Request) -> None:
    for z in req.noise:
        _check_positions(where, "noise.positions", z.positions, len(req.tokens))
        if not z.std >= 0:
            raise PlanError(f"{where}: noise.std {z.std} must be >= 0")


def _check_knockout(where, req: Request, shape: ModelShape) -> None:
    """Layers the model has; query and key positions in the prompt; every query position left some key
    to read (a softmax over no key has no value)."""
    k = req.knockout
    if k is None:
        return
    if not k.layers or not k.queries:
        raise PlanError(f"{where}: knockout needs at least one layer and one query position")
    for layer in k.layers:
        _check_layer(where, "knockout", layer, shape)
    _check_positions(where, "knockout.queries", k.queries, len(req.tokens))
    _check_positions(where, "knockout.keys", k.keys, len(req.tokens))
    blocked = set(k.keys)
    for q in k.queries:
        if blocked >= set(range(q + 1)):
            raise PlanError(f"{where}: knockout blocks every key query position {q} reads (0..{q}): the softmax "
                            "would have nothing to weigh")
    if req.circuit is not None:
        raise PlanError(f"{where}: knockout: a circuit run takes no knockout")


def _check_start_source(where, req: Request, sources, shape: ModelShape):
    """A start layer that skips some layer and runs the last, and its source's stream entering it,
    holding the request's rows (a grid's runs share these: validate checks them once)."""
    s = req.start
    # The last layer must run: the final norm needs a layer's output to read.
    if not 1 <= s.layer < shape.n_layers:
        raise PlanError(f"{where}: start layer {s.layer} is out of range (1..{shape.n_layers - 1}: at least "
                        "one layer is skipped and one runs)")
    if s.source not in sources:
        raise PlanError(f"{where}: start source {s.source!r} is not among the call's sources")
    src = sources[s.source].get(s.key)
    if src is None:
        raise PlanError(f"{where}: start source {s.source!r} holds no {s.key}, the stream entering layer {s.layer}")
    if src.dim() != 2 or src.shape[1] != shape.d_model or src.shape[0] < tree_len(req):
        raise PlanError(f"{where}: start source {s.source!r} {s.key} has shape {tuple(src.shape)}, expected "
                        f"[{tree_len(req)}, {shape.d_model}] (the prompt and its continuations' inputs)")


def _check_start_skips_nothing(where, req: Request):
    """No patch, capture or knockout of the request lies below its start layer."""
    s = req.start
    for p in req.patches:
        if not _at_or_above(p.site, p.layer, s.layer):
            raise PlanError(f"{where}: patch {p.key} lies below start layer {s.layer}, which skips it")
    for key in req.capture:
        if not _at_or_above(*parse_key(key), s.layer):
            raise PlanError(f"{where}: capture {key} lies below start layer {s.layer}, which skips it")
    if req.knockout is not None and min(req.knockout.layers) < s.layer:
        raise PlanError(f"{where}: knockout layer {min(req.knockout.layers)} lies below start layer {s.layer}, "
                        "which skips it")


def _at_or_above(site: str, layer: int | None, start: int) -> bool:
    """Whether a site is computed (or, for the stream entering `start`, written) when the forward
    begins at `start`."""
    if site == "embed":
        return False
    return layer >= start or (site == "resid" and layer == start - 1)


def _check_family(where, site: str, shape: ModelShape) -> None:
    why = shape.family.missing(site)
    if why:
        raise PlanError(f"{where}: site {site}: {why}")


def _check_layer(where, field_name, layer, shape):
    if layer is not None and not 0 <= layer < shape.n_layers:
        raise PlanError(f"{where}: {field_name} layer {layer} is out of range (model has {shape.n_layers} layers)")


def _check_positions(where, field_name, positions, n):
    if not positions or (0 <= min(positions) and max(positions) < n):
        return
    for pos in positions:
        if not 0 <= int(pos) < n:
            raise PlanError(f"{where}: {field_name} position {pos} is out of range (prompt has {n} tokens)")


def _check_patch(where, p: Patch, req: Request, sources, shape: ModelShape, passed: set, source_rows: dict):
    """`passed`: the checks this call's earlier patches passed (the site and unit); `source_rows`: the
    rows of each source, key and prompt length checked so far."""
    if _unchecked(passed, ("unit", p.site, p.layer, p.head, p.neuron, p.whole, p.positions is None)):
        site = _check_patch_site(where, p, shape)
        _check_patch_unit(where, p, site, shape)
        if p.whole and (p.positions is not None or site.unit is not None):
            raise PlanError(f"{where}: patch {p.key} is whole (every row of the request): it takes no positions and "
                            "no unit")
    n = len(req.tokens)
    if p.positions is not None:
        _check_positions(where, "patch.positions", p.positions, n)
    # the source's rows, checked once per source, key and prompt length (a pattern's shape depends on it);
    # then whether they reach as far as this patch reads (each of a grid's positions reads further)
    held = source_rows.get((p.source, p.key, n))
    if held is None:
        held = source_rows[p.source, p.key, n] = _check_patch_source(where, p, sources, n, shape)
    needed = tree_len(req) if p.whole else n if p.positions is None else max(p.positions, default=-1) + 1
    if held < needed:
        raise PlanError(f"{where}: patch source {p.source!r} {p.key} has {held} positions, the patch needs {needed}")


def _check_patch_site(where, p: Patch, shape: ModelShape):
    """The patch's site (its SITES entry): known, on a layer the model has, and patchable there."""
    if p.site not in SITE_KINDS:
        raise PlanError(f"{where}: patch site {p.site!r} is unknown; use one of {', '.join(SITE_KINDS)}")
    if p.site in LAYER_SITES:
        if p.layer is None:
            raise PlanError(f"{where}: patch layer is missing for site {p.site}")
        _check_layer(where, "patch", p.layer, shape)
    site = SITES[p.site]
    _check_family(where, p.site, shape)
    if not site.patchable:
        raise PlanError(f"{where}: site {p.site} can be captured, not patched")
    return site


def _check_patch_unit(where, p: Patch, site, shape: ModelShape) -> None:
    """The head or neuron a patch names: set, in range, for the sites patched by one; unset otherwise.
    The neurons may also be patched whole: every neuron of the layer at once (neuron unset; path
    patching's way into an MLP's input)."""
    for field_name in ("head", "neuron"):
        index = getattr(p, field_name)
        if site.unit_field == field_name:
            what = "key/value head" if site.unit == "kv_head" else site.unit
            if index is None and p.site == "neuron":
                continue
            if index is None or not 0 <= index < shape.units(p.site):
                raise PlanError(f"{where}: patch {field_name} {index} is out of range (model has {shape.units(p.site)} "
                                f"{what}s per layer)")
        elif index is not None:
            raise PlanError(f"{where}: patch {field_name} is set for site {p.site}, which has no {field_name}s")


def _check_patch_source(where, p: Patch, sources, n: int, shape: ModelShape) -> int:
    """The patch's source holds its key, in the site's shape; how many rows (positions) it holds."""
    if p.source not in sources:
        raise PlanError(f"{where}: patch source {p.source!r} is not among the call's sources")
    src = sources[p.source].get(p.key)
    if src is None:
        raise PlanError(f"{where}: patch source {p.source!r} holds no {p.key}")
    if p.site == "pattern":
        _check_pattern_source(where, p, src, n, shape)
        return n
    if src.dim() != 2 or src.shape[1] != shape.width(p.site):
        raise PlanError(f"{where}: patch source {p.source!r} {p.key} has shape {tuple(src.shape)}, "
                        f"expected [tokens, {shape.width(p.site)}]")
    return src.shape[0]


def _check_pattern_source(where, p: Patch, src, n: int, shape: ModelShape) -> None:
    """A pattern patch reads a pattern over a prompt as long as this one: [n, n_heads * n] (query rows,
    each head's weights over the n keys), as a `pattern` capture holds it."""
    want = (n, shape.n_heads * n)
    if tuple(src.shape) != want:
        raise PlanError(f"{where}: patch source {p.source!r} {p.key} has shape {tuple(src.shape)}, expected "
                        f"{list(want)}: the pattern of a {n}-token prompt ({shape.n_heads} heads x {n} keys per "
                        "query row), as a pattern capture of a prompt as long as this one holds it")
