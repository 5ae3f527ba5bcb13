"""A sweep run's settings, validated once when built."""
from __future__ import annotations

from dataclasses import dataclass

from ..rows import DIRECTIONS
from ..sites import QKV
from .kinds import SWEEP_KINDS
from .paths import check_ends

SWEEPS = tuple(SWEEP_KINDS)
DEFAULT_SWEEPS = ("resid", "attn_out", "mlp_out", "heads")
HEAD_POSITION_ROLES = ("subject_last", "last")
# heads and neurons: every position at once plus the head_position_roles' positions, or each
# position one by one
HEAD_POSITIONS = ("roles", "every")
TRACE_SITES = ("resid", "mlp_out", "attn_out")
TRACE_NOISE_SCALE = 3.0  # times the std of the subjects' embeddings over the data set (Meng et al.)
ATP_KINDS = ("resid", "attn_out", "mlp_out", "heads", "neurons")  # what the atp sweep can screen
DEFAULT_ATP_KINDS = ("resid", "attn_out", "mlp_out", "heads")
ATP_CORRECTIONS = ("none", "graddrop")


@dataclass(frozen=True)
class SweepConfig:
    sweeps: tuple[str, ...] = DEFAULT_SWEEPS
    resid_directions: tuple[str, ...] = DIRECTIONS
    head_position_roles: tuple[str, ...] = HEAD_POSITION_ROLES
    head_positions: str = "roles"
    trace_samples: int = 10
    trace_window: int = 10
    trace_noise_scale: float = TRACE_NOISE_SCALE
    trace_sites: tuple[str, ...] = TRACE_SITES  # hidden state, and MLP / attention over a window
    seed: int = 0
    max_requests: int = 2048  # patched runs per engine call: bounds memory
    # Patch only these positions, each on its own (every sweep but heads' defaults: all positions;
    # heads: every position at once and the head_position_roles).
    positions: tuple[int, ...] | None = None
    # Start each patched run at its lowest patched layer from the cached stream of the run it
    # equals below there (plan.Start); False: every patched run computes every layer.
    start_midstack: bool = True
    # atp: the sweep kinds screened, the cells per pair and kind patched exactly (the top K by the
    # ranking score, and R sampled from the rest), and the ranking score: |estimate| (none) or
    # AtP*'s GradDrop score (graddrop)
    atp_kinds: tuple[str, ...] = DEFAULT_ATP_KINDS
    verify_top: int = 20
    verify_random: int = 20
    atp_correction: str = "none"
    # paths: the senders (heads, attn_out, mlp_out: every one of that site; or head.L.H, attn_out.L,
    # mlp_out.L), the receivers (logits; heads: every head of a later layer; or head.L.H), the
    # receiver inputs patched (q, k, v), and whether MLPs after the sender are frozen (direct paths
    # only) or recompute (Wang et al.'s freeze-and-patch): sweeps.paths
    path_senders: tuple[str, ...] = ("heads",)
    path_receivers: tuple[str, ...] = ("logits",)
    path_inputs: tuple[str, ...] = QKV
    path_mlps: str = "frozen"

    def __post_init__(self):
        bad = [s for s in self.sweeps if s not in SWEEPS]
        if bad or not self.sweeps:
            raise ValueError(f"unknown sweep {bad[0] if bad else '(none)'!r}; use some of {', '.join(SWEEPS)}")
        bad = [d for d in self.resid_directions if d not in DIRECTIONS]
        if bad:
            raise ValueError(f"unknown direction {bad[0]!r}; use {' or '.join(DIRECTIONS)}")
        bad = [t for t in self.trace_sites if t not in TRACE_SITES]
        if bad or not self.trace_sites:
            raise ValueError(f"unknown trace site {bad[0] if bad else '(none)'}; use some of {', '.join(TRACE_SITES)}")
        if self.trace_samples < 1 or self.trace_window < 1 or self.max_requests < 1:
            raise ValueError("trace_samples, trace_window and max_requests must be at least 1")
        if self.head_positions not in HEAD_POSITIONS:
            raise ValueError(f"unknown head positions {self.head_positions!r}; use one of {', '.join(HEAD_POSITIONS)}")
        bad = [k for k in self.atp_kinds if k not in ATP_KINDS]
        if bad or not self.atp_kinds:
            raise ValueError(f"unknown atp kind {bad[0] if bad else '(none)'!r}; use some of {', '.join(ATP_KINDS)}")
        if self.verify_top < 0 or self.verify_random < 0:
            raise ValueError(f"verify_top {self.verify_top} and verify_random {self.verify_random} must not be negative")
        if self.atp_correction not in ATP_CORRECTIONS:
            raise ValueError(f"unknown atp correction {self.atp_correction!r}; use one of {', '.join(ATP_CORRECTIONS)}")
        check_ends(self.path_senders, self.path_receivers, self.path_inputs, self.path_mlps)
        if not self.trace_noise_scale >= 0:
            raise ValueError(f"trace_noise_scale {self.trace_noise_scale} must be >= 0")


DEFAULT_PATHS = SweepConfig()  # the paths sweep's defaults (path_*)
