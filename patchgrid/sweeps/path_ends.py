"""The path settings' ends, checked when the settings are built: senders (a head, a layer's attn_out or
mlp_out, or every one of a site), receivers (the logits, heads), the receiver inputs patched and
whether MLPs after the sender recompute (sweeps.paths patches them)."""
from __future__ import annotations

from ..model.sites import LOGITS, QKV, parse_unit_name

SENDER_SITES = ("head", "attn_out", "mlp_out")
SENDER_KINDS = {"heads": "head", "attn_out": "attn_out", "mlp_out": "mlp_out"}  # every one of a site
PATH_MLPS = ("frozen", "recomputed")  # frozen: direct paths only; recomputed: Wang et al.'s full procedure


def check_ends(senders, receivers, inputs, mlps) -> None:
    """Refuse a malformed path setting, naming it (layer and head ranges are checked against the
    model when the grid is built)."""
    for s in senders:
        if s not in SENDER_KINDS:
            site = _parsed(s, "path sender")[0]
            if site not in SENDER_SITES:
                raise ValueError(f"path sender {s!r}: a sender is a head (head.L.H), attn_out.L or mlp_out.L, "
                                 f"or every one of them: {', '.join(SENDER_KINDS)}")
    for r in receivers:
        if r not in (LOGITS, "heads") and _parsed(r, "path receiver")[0] != "head":
            raise ValueError(f"path receiver {r!r}: use logits, heads (every head of a later layer) or head.L.H")
    bad = [x for x in inputs if x not in QKV]
    if bad or not inputs:
        raise ValueError(f"path input {bad[0] if bad else '(none)'!r}: use some of {', '.join(QKV)}")
    if not senders or not receivers:
        raise ValueError("path patching needs at least one sender and one receiver")
    if mlps not in PATH_MLPS:
        raise ValueError(f"path_mlps {mlps!r}: use one of {', '.join(PATH_MLPS)}")


def _parsed(text, what):
    try:
        return parse_unit_name(text)
    except ValueError:
        raise ValueError(f"{what} {text!r}: expected a site's layer and head, e.g. head.3.2, or attn_out.3, "
                         "mlp_out.3") from None
