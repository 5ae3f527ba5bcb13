"""A sweep run's settings, validated once when built."""
from __future__ import annotations

from dataclasses import dataclass

from ..metrics import METRICS
from ..model.sites import QKV
from ..pairs.known import TRACE_FACTS
from ..rows.shapes import DIRECTIONS
from ..settings import SpecError, at_least, normalise_and_check, not_negative, number_list, percent_list, setting
from .path_ends import PATH_MLPS, check_ends
from .registered import SWEEP_KINDS

DEFAULT_SWEEPS = ("resid", "attn_out", "mlp_out", "heads")
HEAD_POSITION_ROLES = ("subject_last", "last")
# heads and neurons: every position at once plus the head_position_roles' positions, or each
# position one by one
HEAD_POSITIONS = ("roles", "every")
TRACE_SITES = ("resid", "mlp_out", "attn_out")
TRACE_NOISE_SCALE = 3.0  # times the std of the subjects' embeddings over the data set (Meng et al.)
ATP_KINDS = ("resid", "attn_out", "mlp_out", "heads", "neurons", "qkv")  # what the atp sweep can screen
DEFAULT_ATP_KINDS = ("resid", "attn_out", "mlp_out", "heads")
ATP_CORRECTIONS = ("none", "graddrop")
EDGE_METHODS = ("eap", "eap-ig")  # patchgrid.methods.edge_attribution.METHODS
EDGE_POSITIONS = ("summed", "each")  # edges summed over the prompt's positions (MIB's), or one per position
CIRCUIT_SIZES = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)  # MIB's, in percent of the graph's edges
CIRCUIT_BUILDS = ("topn", "greedy")  # patchgrid.methods.circuits
ABLATIONS = ("patching", "mean", "zero")  # rows.ABLATIONS


@dataclass(frozen=True)
class SweepConfig:
    """The settings of a sweep run, each declared once (patchgrid.settings): a study's and the
    `sweep` command's options are generated from these fields."""

    sweeps: tuple[str, ...] = setting(DEFAULT_SWEEPS, "the sweep kinds to run, a comma list",
                                      choices=lambda: tuple(SWEEP_KINDS))
    resid_directions: tuple[str, ...] = setting(
        DIRECTIONS, "resid: denoise (clean into corrupt) and noise (corrupt into clean)", choices=DIRECTIONS,
        item="direction", record="if_changed", cli=False)
    head_position_roles: tuple[str, ...] = setting(
        HEAD_POSITION_ROLES, "heads, neurons, qkv and paths: the position roles patched one by one besides every "
        "position at once", record="if_changed", cli=False)
    head_positions: str = setting(
        "roles", "heads, neurons, qkv and paths: every position at once plus the subject's last token and the last "
        "token (roles), or each position one by one (every)", choices=HEAD_POSITIONS, record="if_changed")
    trace_samples: int = setting(10, "trace: noise samples per fact", check=at_least(1))
    trace_window: int = setting(10, "trace: layers restored around each layer for mlp_out and attn_out",
                                check=at_least(1), record="if_changed", cli=False)
    trace_noise_scale: float = setting(TRACE_NOISE_SCALE, "trace: the noise std in stds of the subjects' embeddings",
                                       check=not_negative, record="if_changed", cli=False)
    trace_facts: str = setting(
        "first-token", "trace: the facts traced: first-token (the answer's first token is the model's top-1 next "
        "token; scored by p of the whole answer) or rome (ROME's rule: the top-1 next token is the whole answer, so "
        "answers of several tokens are left out, each with its reason)", choices=TRACE_FACTS, record="if_changed")
    trace_sites: tuple[str, ...] = setting(TRACE_SITES, "trace: the sites restored: the hidden state, and the MLP "
                                           "and attention outputs over a window", choices=TRACE_SITES,
                                           record="if_changed", cli=False)
    seed: int = setting(0, "seed for drawing subject-swap partners, trace noise and atp's random sites")
    max_requests: int = setting(2048, "patched runs per engine call (bounds memory; the numbers do not change)",
                                check=at_least(1), record="never")
    # Patch only these positions, each on its own (every sweep but heads' defaults: all positions;
    # heads: every position at once and the head_position_roles); and only these layers.
    positions: tuple[int, ...] | None = setting(
        None, "patch only these prompt positions, each on its own, in every sweep (e.g. 0,2,5 or 0-3,7; a pair's "
        "prompt shorter than a position leaves it out); default: every position, and for heads, neurons, qkv and "
        "paths every position at once and the roles' positions (edges and circuit: every position, knockout: the "
        "last, whatever this says)",
        record="if_changed", parse=number_list)
    layers: tuple[int, ...] | None = setting(
        None, "patch only these layers (e.g. 0,2,5 or 0-3,7; refused past the model's last layer): the layers of "
        "the layer sweeps, trace's restored layers (window centres), the cells atp estimates and verifies, and the "
        "paths senders and receivers given as every one (heads, attn_out, mlp_out); default: every layer (edges, "
        "circuit: every edge of the graph, whatever this says)",
        record="if_changed", parse=number_list)
    start_midstack: bool = setting(
        True, "start each patched run at its lowest patched layer from the cached stream below it (plan.Start); "
        "--no-start-midstack runs every layer of every patched run (the numbers are the same)")
    metrics: tuple[str, ...] = setting(
        tuple(METRICS), "the metrics each patched run reads, a comma list (each sweep's headline metric, which its "
        "effect and recovery are on, is read whatever this says); the others are left NULL in its effect rows and "
        "cost nothing: kl and rank each a pass over the vocabulary, and logit_diff alone skips the vocabulary's "
        "unembedding at the read row (patchgrid.metrics)", choices=tuple(METRICS), item="metric",
        record="if_changed")
    atp_kinds: tuple[str, ...] = setting(DEFAULT_ATP_KINDS, "atp: the sweep kinds it screens, a comma list",
                                         choices=ATP_KINDS, record="if_used")
    verify_top: int = setting(20, "atp: per pair, site and scope (every position at once, or one), patch the K "
                                  "largest scores exactly; edges: per pair, the K edges of largest |score|",
                              check=not_negative, record="if_used")
    verify_random: int = setting(20, "atp and edges: and R sites (edges) sampled from the rest (seeded by --seed)",
                                 check=not_negative, record="if_used")
    atp_qk_fix: bool = setting(True, "atp: estimate q and k (the qkv kind) with AtP*'s QK fix, the attention pattern "
                               "recomputed with the patched query or key; --no-atp-qk-fix: plain AtP, linear "
                               "through the softmax", record="if_used")
    atp_correction: str = setting("none", "atp: rank sites by |estimate| (none) or by AtP*'s GradDrop score "
                                  "(graddrop)", choices=ATP_CORRECTIONS, record="if_used")
    edge_method: str = setting("eap-ig", "edges: score every edge by EAP (one corrupt forward and backward) or "
                               "EAP-IG (the gradient averaged over --ig-steps inputs from the corrupt to the clean "
                               "one)", choices=EDGE_METHODS, record="if_used")
    ig_steps: int = setting(30, "edges: EAP-IG's steps (the EAP-IG code's default)", check=at_least(1),
                            record="if_used")
    edge_positions: str = setting("summed", "edges: one score per edge summed over the prompt's positions (summed, "
                                  "as MIB's) or one per edge and position (each)", choices=EDGE_POSITIONS,
                                  record="if_used")
    circuit_sizes: tuple[float, ...] = setting(
        CIRCUIT_SIZES, "circuit: the circuits' sizes in percent of the graph's edges, each in (0, 100] (MIB's ten by "
        "default)", parse=percent_list, record="if_used")
    circuit_build: str = setting("topn", "circuit: the edges of largest |mean score| over the pairs (topn), or MIB's "
                                 "greedy construction from the logits down (greedy)", choices=CIRCUIT_BUILDS,
                                 record="if_used")
    ablation: str = setting(
        "patching", "what a patch or an edge outside a circuit gets: the other run's value (patching), the data "
        "set's mean at that site and position role (mean), or zero (zero); circuit and the exact site sweeps "
        "(resid, resid_pre, resid_mid, attn_out, mlp_out, embed, heads, neurons, qkv)", choices=ABLATIONS,
        record="if_changed")
    knockout_window: int = setting(9, "knockout: the layers blocked around each layer, a window centred on it and cut "
                                   "at the model's ends (Geva et al.'s k; 9 is theirs for GPT-2 as we read the paper)",
                                   check=at_least(1), record="if_used")
    path_senders: tuple[str, ...] = setting(
        ("heads",), "paths: senders, a comma list: heads, attn_out, mlp_out (every one) or head.L.H, attn_out.L, "
        "mlp_out.L", record="if_used")
    path_receivers: tuple[str, ...] = setting(
        ("logits",), "paths: receivers, a comma list: logits, heads (every head of a later layer) or head.L.H",
        record="if_used")
    path_inputs: tuple[str, ...] = setting(QKV, "paths: the receiver heads' inputs patched, a comma list of q, k, v",
                                           record="if_used")
    path_mlps: str = setting("frozen", "paths: MLPs after the sender frozen (direct paths only) or recomputed "
                             "(Wang et al.'s freeze-and-patch: paths through MLPs count)", choices=PATH_MLPS,
                             record="if_used")

    def __post_init__(self):
        normalise_and_check(self)
        check_sweep_needs(self)
        try:
            check_ends(self.path_senders, self.path_receivers, self.path_inputs, self.path_mlps)
        except ValueError as exc:
            raise SpecError(None, str(exc)) from None


def check_sweep_needs(config) -> None:
    """Refuse sweep kinds run without what they build on (or after it), in one line."""
    for name in config.sweeps:
        kind = SWEEP_KINDS[name]
        missing = [need for need in kind.builds_on if need not in config.sweeps]
        if missing:
            raise SpecError("sweeps", f"{{name}}: {name} {kind.builds_on_why}: add {missing[0]} to the sweeps")
    order = list(config.sweeps)
    for name in order:
        for need in SWEEP_KINDS[name].builds_on:
            if order.index(need) > order.index(name):
                raise SpecError("sweeps", f"{{name}}: {need} must come before {name}, which builds on it")

