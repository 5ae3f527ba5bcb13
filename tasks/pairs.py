from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task

from patchgrid.engine import EnginePool
from patchgrid.spec import StudySpec

from .keys import keyed_on


@task(cache_key_fn=keyed_on("model", "pairs", "pairs_format", "require_known", "answer_policy", "seed", "backend",
                                  "sweeps"),
      persist_result=True)
def align_pairs(spec: StudySpec, model_sha256: str, out: str, engines: EnginePool) -> str:
    """Read the data set, pair and align it with the model's tokenizer; write the pairs table."""
    from patchgrid.pairs import build_from_source, summary, write_pairs

    # the model is asked when pairs must be known, and when tracing needs the facts it knows alone
    ask = spec.require_known or "trace" in spec.sweeps
    engine = engines.get(spec.model, spec.backend) if ask else None
    fmt, records, rows = build_from_source(spec.model, spec.pairs, spec.pairs_format, seed=spec.seed, engine=engine,
                                           require_known=spec.require_known, answer_policy=spec.answer_policy)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    write_pairs(rows, out)
    counts = ", ".join(f"{status}{'/' + reason if reason else ''}: {n}" for (status, reason), n in summary(rows).items())
    get_run_logger().info("%s: %d records (format %s; %s) -> %s", spec.pairs, len(records), fmt, counts, out)
    return out
