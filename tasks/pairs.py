from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task

from patchgrid.backends.engine import Engines, using_engine
from patchgrid.pipeline.spec import StudySpec

from .keys import keyed_by


def pairing_inputs(spec: StudySpec) -> dict:
    """What a run's pairs table depends on: the data set, the model and how pairs are chosen; the
    model is asked when pairs must be known, and when a sweep kind's population needs its
    predictions (causal tracing's facts known alone). Where it is asked, the study's limit says how
    far judging goes: until the first N members of each of the study's populations are found."""
    from patchgrid.sweeps import POPULATIONS, SWEEP_KINDS

    ask = spec.require_known or any(SWEEP_KINDS[name].population.asks_model for name in spec.sweeps)
    populations = {SWEEP_KINDS[name].population for name in spec.sweeps}
    until = tuple(p.name for p in POPULATIONS if p in populations) if ask and spec.limit is not None else ()
    # a population chosen by a rule (causal tracing's trace_facts) is judged until N members under it
    rules = {p.rule: getattr(spec.sweep, p.rule) for p in POPULATIONS if p.name in until and p.rule}
    return dict(model=spec.model, backend=spec.backend, source=spec.pairs, fmt=spec.pairs_format,
                seed=spec.sweep.seed, require_known=spec.require_known, answer_policy=spec.answer_policy,
                ask_model=ask, limit=spec.limit if until else None, until=until, rules=rules)


def judging_limit(v: dict):
    """The pairs layer's Limit for `pairing_inputs` `v`: N members of each population named in `until`."""
    from functools import partial

    from patchgrid.pairs import Limit
    from patchgrid.sweeps import POPULATIONS, SweepConfig

    if v["limit"] is None:
        return None
    chosen = [p for p in POPULATIONS if p.name in v["until"]]
    config = SweepConfig(**v.get("rules", {}))
    return Limit(v["limit"], tuple(partial(p.members, config=config) for p in chosen),
                 tuple(p.counted_as for p in chosen))


@task(cache_key_fn=keyed_by(pairing_inputs), persist_result=True, retries=2, retry_delay_seconds=1)
def align_pairs(spec: StudySpec, model_sha256: str, out: str, engines: Engines) -> str:
    """Read the data set, pair and align it with the model's tokenizer; write the pairs table. Where
    the model is asked, that runs where the engines run."""
    from patchgrid.pairs import build_from_source, summary, write_pairs

    v = pairing_inputs(spec)
    args = (v["model"], v["source"], v["fmt"])
    kwargs = dict(seed=v["seed"], require_known=v["require_known"], answer_policy=v["answer_policy"],
                  limit=judging_limit(v))
    if v["ask_model"]:
        fmt, records, rows = engines.run(using_engine(build_from_source, *args, **kwargs))
    else:
        fmt, records, rows = build_from_source(*args, engine=None, **kwargs)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    write_pairs(rows, out)
    counts = ", ".join(f"{status}{'/' + reason if reason else ''}: {n}"
                       for (status, reason), n in summary(rows).items())
    get_run_logger().info("%s: %d records (format %s; %s) -> %s", v["source"], len(records), fmt, counts, out)
    return out
