"""What a study is asked to do: one frozen, validated value built at the edge (the CLI's arguments
or the flow's parameters) and handed to the flow and its tasks; and a shard's share of the work.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .engine import BACKENDS, DEFAULT_BACKEND
from .models import DEFAULT_MODEL
from .pairs.pair import Pair
from .rows import ANSWER_POLICIES
from .shipped import SHIPPED_PAIRS
from .sweeps import DEFAULT_SWEEPS, SWEEPS, SweepConfig
from .sweeps.config import DEFAULT_ATP_KINDS, DEFAULT_PATHS

PATH_LISTS = ("path_senders", "path_receivers", "path_inputs")  # comma lists on the command line and in flows

RUNNERS = ("local", "ray")
RUN_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# A field whose value is where something is written: it counts in cache keys by its path, never by
# what an earlier run left there.
OUTPUT = {"output": True}


class SpecError(ValueError):
    """A study parameter that cannot work. The message names the parameter as the flow calls it;
    `flag_message` names it as the command line does."""

    FLAGS = {"pairs_format": "--format"}

    def __init__(self, name: str | None, detail: str):
        self.name, self.detail = name, detail
        super().__init__(f"{name} {detail}" if name else detail)

    @property
    def flag_message(self) -> str:
        if not self.name:
            return self.detail
        return f"{self.FLAGS.get(self.name, '--' + self.name.replace('_', '-'))} {self.detail}"


def sweep_names(sweeps) -> tuple[str, ...]:
    """`resid,heads` or a sequence of names, as a tuple of names."""
    names = sweeps.split(",") if isinstance(sweeps, str) else list(sweeps)
    return tuple(n.strip() for n in names if n.strip())


@dataclass(frozen=True)
class StudySpec:
    model: str = DEFAULT_MODEL
    pairs: str = SHIPPED_PAIRS  # a data-set file or a hub data-set name (owner/name)
    sweeps: tuple[str, ...] = DEFAULT_SWEEPS
    limit: int | None = None  # the first N accepted pairs
    warehouse: str = field(default="warehouse.duckdb", metadata=OUTPUT)
    workdir: str = field(default=".patchgrid", metadata=OUTPUT)  # pairs tables, shard files, the cache
    pairs_format: str | None = None
    require_known: bool = True
    answer_policy: str = "full"  # multi-token answers: full (scored whole), single (rejected), first-token
    seed: int = 0
    trace_samples: int = 10
    trace_noise: float | None = None  # default: 3 x std of the data set's subject embeddings
    shard_size: int = 8  # pairs per sweep task
    backend: str = DEFAULT_BACKEND
    max_requests: int = 2048  # patched runs per engine call
    skip: bool = True  # patched runs start at their lowest patched layer (False: every layer runs)
    run_id: str | None = None  # default: derived from the model and these parameters
    runner: str = "local"
    ray_address: str | None = None
    ray_workers: int = 2
    gpus_per_engine: float = 0.0
    tensor_parallel_size: int = 1
    # the atp sweep: the kinds it screens, the sites per pair and kind it patches exactly (top K by
    # the ranking score, and R sampled from the rest), and AtP*'s correction ranking them
    atp_kinds: tuple[str, ...] = DEFAULT_ATP_KINDS
    verify_top: int = 20
    verify_random: int = 20
    atp_correction: str = "none"
    head_positions: str = "roles"  # heads and neurons: all at once + roles, or every position one by one
    # the paths sweep: senders, receivers, the receivers' inputs patched, and the MLPs after the
    # sender frozen (direct paths) or recomputed (Wang et al.): patchgrid.sweeps.paths
    path_senders: tuple[str, ...] = DEFAULT_PATHS.path_senders
    path_receivers: tuple[str, ...] = DEFAULT_PATHS.path_receivers
    path_inputs: tuple[str, ...] = DEFAULT_PATHS.path_inputs
    path_mlps: str = DEFAULT_PATHS.path_mlps

    def __post_init__(self):
        object.__setattr__(self, "sweeps", sweep_names(self.sweeps))
        object.__setattr__(self, "atp_kinds", sweep_names(self.atp_kinds))
        for name in PATH_LISTS:
            object.__setattr__(self, name, sweep_names(getattr(self, name)))
        if not self.sweeps:
            raise SpecError("sweeps", f"is empty; use some of {', '.join(SWEEPS)}")
        for name in ("limit", "shard_size", "trace_samples", "max_requests", "ray_workers", "tensor_parallel_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise SpecError(name, f"{value} must be at least 1")
        for name in ("verify_top", "verify_random"):
            if getattr(self, name) < 0:
                raise SpecError(name, f"{getattr(self, name)} must not be negative")
        try:
            self.sweep_config()  # the sweeps' own checks, naming what is wrong
        except ValueError as exc:
            raise SpecError(None, str(exc)) from None
        if self.trace_noise is not None and not self.trace_noise > 0:
            raise SpecError("trace_noise", f"{self.trace_noise} must be above 0")
        if self.gpus_per_engine < 0:
            raise SpecError("gpus_per_engine", f"{self.gpus_per_engine} must not be negative")
        if self.answer_policy not in ANSWER_POLICIES:
            raise SpecError("answer_policy", f"{self.answer_policy!r} is not one of {', '.join(ANSWER_POLICIES)}")
        if self.backend not in BACKENDS:
            raise SpecError("backend", f"{self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.runner not in RUNNERS:
            raise SpecError("runner", f"{self.runner!r} is not one of {', '.join(RUNNERS)}")
        if self.ray_address and self.runner != "ray":
            raise SpecError("ray_address", "needs runner ray")
        if self.tensor_parallel_size > 1 and self.runner != "ray":
            raise SpecError("tensor_parallel_size", "> 1 runs in Ray engine actors: use runner ray")
        if self.run_id is not None and not RUN_ID.match(self.run_id):
            raise SpecError("run_id", f"{self.run_id!r} may hold only letters, digits, '.', '_' and '-' (64 at most)")

    def sweep_config(self) -> SweepConfig:
        return SweepConfig(sweeps=self.sweeps, trace_samples=self.trace_samples, seed=self.seed,
                           max_requests=self.max_requests, start_midstack=self.skip, atp_kinds=self.atp_kinds,
                           verify_top=self.verify_top, verify_random=self.verify_random,
                           atp_correction=self.atp_correction, head_positions=self.head_positions,
                           **self.path_settings())

    def path_settings(self) -> dict:
        return {name: getattr(self, name) for name in PATH_LISTS + ("path_mlps",)}

    def recorded_params(self) -> dict:
        """What a run records as its parameters, and what its default run id is derived from."""
        params = dict(model=self.model, pairs=self.pairs, sweeps=list(self.sweeps), limit=self.limit,
                      pairs_format=self.pairs_format, require_known=self.require_known,
                      answer_policy=self.answer_policy, seed=self.seed,
                      trace_samples=self.trace_samples, trace_noise=self.trace_noise, backend=self.backend,
                      skip=self.skip)
        if self.head_positions != "roles":  # only then: the run ids of earlier studies stay as they were
            params["head_positions"] = self.head_positions
        if "atp" in self.sweeps:  # only then: the run ids of studies without it stay as they were
            params.update(atp_kinds=list(self.atp_kinds), verify_top=self.verify_top,
                          verify_random=self.verify_random, atp_correction=self.atp_correction)
        if "paths" in self.sweeps:  # likewise
            params.update({k: list(v) if isinstance(v, tuple) else v for k, v in self.path_settings().items()})
        return params

    def flow_parameters(self) -> dict:
        """The study flow's parameters for this spec (the flow builds the same spec from them)."""
        params = asdict(self)
        params["sweeps"] = ",".join(self.sweeps)
        params["atp_kinds"] = ",".join(self.atp_kinds)
        for name in PATH_LISTS:
            params[name] = ",".join(getattr(self, name))
        return params

    def engine_options(self) -> dict:
        return {"tensor_parallel_size": self.tensor_parallel_size} if self.tensor_parallel_size > 1 else {}

    def with_run_id(self, run_id: str) -> StudySpec:
        return replace(self, run_id=run_id)

    def check_inputs(self) -> None:
        """What can be checked on this machine before any work starts: the data set and the
        warehouse's folder exist, the warehouse can be written, the runner's packages are there."""
        from .warehouse.loader import check_writable

        source = Path(self.pairs)
        is_hub_name = self.pairs.count("/") == 1 and not self.pairs.startswith((".", "/", "~"))
        if not source.exists() and not is_hub_name:
            raise SpecError("pairs", f"{self.pairs}: no such file (nor a hub data-set name owner/name)")
        if source.is_file():
            from .pairs import read_source

            read_source(self.pairs, self.pairs_format)  # a file that cannot be read stops here, naming its line
        wh = Path(self.warehouse)
        if wh.parent != Path("") and not wh.parent.is_dir():
            raise SpecError("warehouse", f"{self.warehouse}: folder {wh.parent} does not exist")
        check_writable(wh)
        if self.runner == "ray":
            try:
                import prefect_ray  # noqa: F401
                import ray  # noqa: F401
            except ImportError:
                raise SpecError("runner", "ray needs ray and prefect-ray (pip install 'patchgrid[ray]')") from None


@dataclass(frozen=True)
class ShardSpec:
    """One shard of a study's sweeps: which pairs, from which cache, written where."""

    index: int
    pairs: tuple[Pair, ...]
    cache_folder: str
    sweeps: SweepConfig
    noise_std: float  # the trace noise scale, set by the whole data set's subjects
    out: str = field(metadata=OUTPUT)  # the effects Parquet file; its existence marks the shard done
    writes_baselines: bool = True  # the pairs' baselines (tracing's facts have none of their own)

    @property
    def baselines_out(self) -> str:
        """The shard's pairs' baselines, written beside its effects (before them)."""
        out = Path(self.out)
        return str(out.with_name(f"baselines-{out.name}"))

    @property
    def pair_ids(self) -> list[str]:
        return [p.pair_id for p in self.pairs]
