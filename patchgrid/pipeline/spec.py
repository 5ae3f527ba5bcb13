"""What a study is asked to do: one frozen, validated value built at the edge (the CLI's arguments
or the flow's parameters) and handed to the flow and its tasks; and a shard's share of the work.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..backends.engine import BACKENDS, DEFAULT_BACKEND, DTYPES
from ..model.models import DEFAULT_MODEL
from ..pairs.pair import Pair
from ..pairs.shipped import SHIPPED_PAIRS
from ..pairs.sources import FORMATS
from ..rows.shapes import ANSWER_POLICIES
from ..settings import (
    SpecError,
    above_zero,
    at_least,
    flag_of,
    normalise_and_check,
    not_negative,
    recorded,
    setting,
    settings_fields,
)
from ..sweeps import SweepConfig
from .fingerprint import fingerprint

RUNNERS = ("local", "ray")
VLLM_SIZES = ("gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens")  # the vLLM engine's, by name
RUN_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
DEVICE = re.compile(r"^(cpu|cuda(:[0-9]+)?)$")
ATP_DTYPES = ("float32", "bfloat16", "float16")  # the gradient model's (patchgrid.methods.attribution)
LABEL_LENGTH = 200  # a run's name (--name), at most


def _run_id(value) -> str | None:
    if value is None or RUN_ID.match(value):
        return None
    return f"{{name}} {value!r} may hold only letters, digits, '.', '_' and '-' (64 at most)"


def _fraction(value) -> str | None:
    return None if value is None or 0 < value <= 1 else f"{{name}} {value} must be above 0 and at most 1"


def _device(value) -> str | None:
    if value is None or DEVICE.match(value):
        return None
    return f"{{name}} {value!r} is not a device: use cpu, cuda or cuda:N"


def check_sweep_settings_apply(config: SweepConfig, study=None) -> None:
    """A setting that only some sweep kinds read (their `settings`: the sweeps' own, and the study's
    where `study` is given) and that differs from its default is refused when none of those kinds
    runs: it would change nothing; so is an ablation none of them takes."""
    from ..sweeps import SWEEP_KINDS, settings_of

    holders = [(f, config) for f in settings_fields(SweepConfig)]
    holders += [(f, study) for f in settings_fields(type(study))] if study is not None else []
    for f, holder in holders:
        value, readers = getattr(holder, f.name), [n for n, kind in SWEEP_KINDS.items() if f.name in kind.settings]
        if readers and value != f.default and f.name not in settings_of(config.sweeps):
            kinds = " and ".join(readers) + (" sweeps" if len(readers) > 1 else " sweep")
            raise SpecError(f.name, f"{{name}} applies only to the {kinds} (--sweeps {','.join(config.sweeps)})",
                            flag_of(f))
    # an ablation applies to the kinds that take one (SweepKind.ablatable); the others run as they do
    # beside them, and rows say which took it
    if config.ablation != "patching" and not any(SWEEP_KINDS[n].ablatable for n in config.sweeps):
        first = config.sweeps[0]
        raise SpecError("ablation", f"{{name}} {config.ablation}: none of the sweeps {','.join(config.sweeps)} "
                                    f"takes it ({first}: {SWEEP_KINDS[first].ablatable_why}); it applies to circuit "
                                    "and the exact site sweeps")


def _label(value) -> str | None:
    if value is None or (0 < len(value) <= LABEL_LENGTH and value.isprintable() and value.strip()):
        return None
    shown = repr(value[:LABEL_LENGTH]).replace("{", "{{").replace("}", "}}")
    return f"{{name}} {shown}: a label is one line of 1 to {LABEL_LENGTH} printable characters"


def dtype_option(dtype: str) -> dict:
    """An engine's dtype as an option, left out at auto (the model's own, load_engine's default): what
    was computed before dtype was a setting keeps its run ids and cache keys."""
    return {} if dtype == "auto" else {"dtype": dtype}


def run_params(own: dict, sweep: SweepConfig, *, noted: bool = True) -> dict:
    """A run's parameters: `own` (the command's settings, already as recorded) and the settings of
    `sweep` that its kinds read, each by its declaration (patchgrid.settings.recorded); `noted`
    False leaves out the `noted` ones (how engines were sized, where a pass ran), which leave the
    numbers as they are: what a run's default id is derived from."""
    from ..sweeps import settings_of

    return {**own, **recorded(sweep, set(settings_of(sweep.sweeps)), noted=noted)}


def default_run_id(prefix: str, model_sha256: str, own: dict, sweep: SweepConfig) -> str:
    """A run's id when none is given, the one rule for every command that writes runs: `prefix`
    (`run` for a study, `sweep` for `patchgrid sweep`) and a fingerprint of the model's weights and
    the run's parameters but the noted ones (run_params). The same inputs give the same run id: a
    rerun replaces its rows, never duplicates them."""
    return f"{prefix}-{fingerprint(model_sha256, run_params(own, sweep, noted=False))[:12]}"


@dataclass(frozen=True)
class StudySpec:
    """A whole study: its own settings, and its sweeps' settings (`sweep`), each declared once
    (patchgrid.settings). Build one from flat settings with `StudySpec.of(model=..., sweeps=...)`."""

    model: str = setting(DEFAULT_MODEL, "a built-in model name, a model folder or a hub id")
    pairs: str = setting(SHIPPED_PAIRS, "a data set: .jsonl, .json, .parquet or a hub data-set name (owner/name)")
    limit: int | None = setting(None, "the first N accepted pairs (and traced facts)", check=at_least(1))
    warehouse: str = setting("warehouse.duckdb", "the DuckDB warehouse file", record="never", output=True)
    workdir: str = setting(".patchgrid", "pairs tables, effect shards, activation cache", record="never",
                           output=True)
    pairs_format: str | None = setting(None, "the data set's format (default: detected from its fields)",
                                       choices=FORMATS, flag="--format")
    require_known: bool = setting(True, "keep only pairs the model knows: clean log-probability difference "
                                  "(log p(clean answer) - log p(corrupt answer)) positive, corrupt negative")
    answer_policy: str = setting("full", "full: score a multi-token answer whole (teacher-forced); single: reject "
                                 "multi-token answers; first-token: keep their first token (recorded per pair)",
                                 choices=ANSWER_POLICIES)
    trace_noise: float | None = setting(None, "std of causal tracing's noise (default: 3 x std of the data set's "
                                        "subject embeddings)", check=above_zero)
    shard_size: int = setting(8, "pairs per sweep task", check=at_least(1), record="never")
    backend: str = setting(DEFAULT_BACKEND, "the engine", choices=BACKENDS)
    dtype: str = setting("auto", "the engine's dtype (auto: the model's own; float32 where the numbers are compared "
                         "with a float32 implementation, or across CPUs and GPUs, whose bf16 kernels round "
                         "differently); recorded, and in the run id when not auto", choices=DTYPES, record="if_changed")
    run_id: str | None = setting(None, "the run's id (default: derived from the model and the recorded settings)",
                                 check=_run_id, record="never")
    runner: str = setting("local", "local: shards one after another in this process; ray: shards as Ray tasks",
                          choices=RUNNERS, record="never")
    ray_address: str | None = setting(None, "a Ray cluster (default: a local Ray the flow starts)", record="never",
                                       applies_with=("runner", "ray"))
    ray_workers: int = setting(2, "engine actors, each one vLLM engine (Ray runner)", check=at_least(1),
                               record="never", applies_with=("runner", "ray"))
    gpus_per_engine: float | None = setting(None, "GPUs per engine actor (Ray runner; default: tensor_parallel_size "
                                            "on a cluster with GPUs, 0 on one without)", check=not_negative,
                                            record="never", applies_with=("runner", "ray"))
    tensor_parallel_size: int = setting(1, "ranks per engine (Ray runner)", check=at_least(1), record="never",
                                        applies_with=("runner", "ray"))
    ray_timeout_s: float = setting(3600.0, "the longest wait on Ray for one call, an engine actor's start or one "
                                   "stage's work (Ray runner)", check=above_zero, record="never",
                                   applies_with=("runner", "ray"))
    gpu_memory_utilization: float | None = setting(
        None, "vllm: the fraction of each GPU's memory an engine may take, weights and KV cache (default: vLLM's "
        "own on a GPU, lowered by the atp memory plan to make room for the gradient model; 0.3 of the host's on "
        "CPU); how an engine is sized, not its numbers: recorded, not in the run id", check=_fraction,
        record="noted")
    max_num_seqs: int | None = setting(None, "vllm: sequences per engine step (default: vLLM's own on a GPU, 1024 "
                                       "on CPU); recorded, not in the run id", check=at_least(1), record="noted")
    max_num_batched_tokens: int | None = setting(None, "vllm: tokens per engine step (default: vLLM's own on a GPU, "
                                                 "16384 on CPU); recorded, not in the run id", check=at_least(1),
                                                 record="noted")
    atp_device: str | None = setting(None, "atp: where the gradient model runs: cpu, cuda or cuda:N (default: the "
                                     "engine's GPU when there is one, else cpu); its numbers agree within float "
                                     "noise on any device: recorded, not in the run id", check=_device,
                                     record="noted")
    atp_dtype: str = setting("float32", "atp: the gradient model's dtype (the estimates are a linearisation; half "
                             "precision adds its own error, so it changes the numbers: recorded, and in the run id "
                             "when not float32, the default)", choices=ATP_DTYPES, record="if_changed")
    name: str | None = setting(None, "a label for the run, shown in the warehouse's runs (run_overview.name) and the "
                               "summary (serve: also the deployment's name, default patchgrid-study); recorded, not "
                               "in the run id", check=_label, record="noted")
    config: str | None = setting(None, "the study file's content (TOML) the settings were read from (patchgrid "
                                 "study --config FILE, patchgrid.study(config=FILE)); recorded, not in the run id",
                                 record="noted", cli=False)
    sweep: SweepConfig = field(default=SweepConfig())

    def __post_init__(self):
        if isinstance(self.sweep, dict):  # a flow parameter given as JSON
            object.__setattr__(self, "sweep", SweepConfig(**self.sweep))
        normalise_and_check(self)  # the Ray settings too: each applies only with runner ray (applies_with)
        check_sweep_settings_apply(self.sweep, self)

    @classmethod
    def of(cls, **settings) -> StudySpec:
        """A spec from flat settings, the study's own and its sweeps'."""
        own = {f.name for f in dataclasses.fields(cls)}
        theirs = {k: settings.pop(k) for k in list(settings) if k not in own}
        unknown = set(theirs) - {f.name for f in dataclasses.fields(SweepConfig)}
        if unknown:
            raise SpecError(None, f"unknown setting {sorted(unknown)[0]!r}")
        base = settings.pop("sweep", SweepConfig())
        if isinstance(base, dict):
            base = SweepConfig(**base)
        return cls(**settings, sweep=replace(base, **theirs) if theirs else base)

    @property
    def sweeps(self) -> tuple[str, ...]:
        return self.sweep.sweeps

    def replace(self, **settings) -> StudySpec:
        """This spec with some settings changed, the study's own or its sweeps'."""
        current = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return StudySpec.of(**{**current, **settings})

    def flat(self) -> dict:
        """Every setting by name, the sweeps' beside the study's own (what `of` takes)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "sweep"}
        return {**out, **{f.name: getattr(self.sweep, f.name) for f in dataclasses.fields(self.sweep)}}

    def recorded_params(self) -> dict:
        """What a run records as its parameters: every setting by its declaration
        (patchgrid.settings.RECORDS), the `noted` ones included."""
        return run_params(recorded(self, set()), self.sweep)

    def default_run_id(self, model_sha256: str) -> str:
        """The run id a study takes when none is given (`run-…`: default_run_id's rule), derived from
        the recorded parameters but the `noted` ones (how engines were sized, where a pass ran),
        which leave the numbers as they are."""
        return default_run_id("run", model_sha256, recorded(self, set(), noted=False), self.sweep)

    def engine_identity(self) -> dict:
        """Which engine the study's numbers come from: its model, its backend and its dtype (dtype_option)."""
        return dict(model=self.model, backend=self.backend, **dtype_option(self.dtype))

    def engine_options(self) -> dict:
        """What every engine of the study starts with (load_engine's options for its backend): its dtype
        when not auto, its ranks, and the vLLM engine's sizes, each only when set (unset: the device's
        defaults, patchgrid.backends.vllm); the hf engine has no such sizes and ignores them."""
        dtype = dtype_option(self.dtype)
        tp = {"tensor_parallel_size": self.tensor_parallel_size} if self.tensor_parallel_size > 1 else {}
        if self.backend != "vllm":
            return {**dtype, **tp}
        return {**dtype, **tp, **{name: getattr(self, name) for name in VLLM_SIZES if getattr(self, name) is not None}}

    def attribution_options(self) -> dict:
        """The gradient model's device and dtype (patchgrid.methods.attribution.attributor_for's options)."""
        return {"device": self.atp_device, "dtype": self.atp_dtype}

    def with_run_id(self, run_id: str) -> StudySpec:
        return replace(self, run_id=run_id)

    def check_inputs(self) -> None:
        """What can be checked on this machine before any work starts: the data set exists, the
        warehouse can be written (a missing folder of it is made by its first write, not here:
        a study refused later leaves no file), the runner's packages are there."""
        from ..warehouse.loader import check_writable

        source = Path(self.pairs)
        is_hub_name = self.pairs.count("/") == 1 and not self.pairs.startswith((".", "/", "~"))
        if not source.exists() and not is_hub_name:
            raise SpecError("pairs", f"{self.pairs}: no such file (nor a hub data-set name owner/name)")
        if source.is_file():
            from ..pairs import read_source

            read_source(self.pairs, self.pairs_format)  # a file that cannot be read stops here, naming its line
        check_writable(self.warehouse)  # one not there yet is left unmade: its first write makes it, folders too
        if self.runner == "ray":
            try:
                import ray  # noqa: F401
            except ImportError as exc:
                raise SpecError("runner", f"ray needs Ray (pip install 'patchgrid[ray]'): {exc}") from exc


@dataclass(frozen=True)
class ShardSpec:
    """One shard of a study's sweeps: which pairs, from which cache, written where."""

    index: int
    pairs: tuple[Pair, ...]
    cache_folder: str
    sweep: SweepConfig  # the settings of the shard's sweeps, as StudySpec.sweep
    noise_std: float  # the trace noise scale, set by the whole data set's subjects
    out: str = field(metadata={"output": True})  # the effects Parquet file; its existence marks the shard done
    writes_baselines: bool = True  # the pairs' baselines (tracing's facts have none of their own)
    # the atp sweep's gradient model: attributor_for's options (StudySpec.attribution_options); empty: its defaults
    attribution: dict = field(default_factory=dict)

    @property
    def baselines_out(self) -> str:
        """The shard's pairs' baselines, written beside its effects (before them)."""
        out = Path(self.out)
        return str(out.with_name(f"baselines-{out.name}"))

    @property
    def pair_ids(self) -> list[str]:
        return [p.pair_id for p in self.pairs]
