"""Task cache keys: derived from the values a task's result depends on (the function its body computes
them with), the same before and after the task wrote its output."""
from __future__ import annotations

from types import SimpleNamespace

from patchgrid.backends.engine import EnginePool
from patchgrid.pipeline.spec import StudySpec
from patchgrid.tasks.cache import cache_inputs
from patchgrid.tasks.keys import engine_inputs, keyed_by
from patchgrid.tasks.pairs import pairing_inputs

CONTEXT = SimpleNamespace(task=SimpleNamespace(name="align_pairs"))


def test_an_output_counts_by_its_path_not_by_what_is_there(tmp_path):
    """The cause of a rerun that recomputed align_pairs: its `out` file, once written, changed the key."""
    key = keyed_by(pairing_inputs)
    out = tmp_path / "pairs.parquet"
    params = dict(spec=StudySpec(), model_sha256="abc", out=str(out), engines=EnginePool())
    before = key(CONTEXT, params)
    out.write_bytes(b"the table")
    assert key(CONTEXT, params) == before
    assert key(CONTEXT, {**params, "out": str(tmp_path / "elsewhere.parquet")}) != before


def test_only_what_the_result_depends_on_counts(tmp_path):
    key = keyed_by(pairing_inputs)
    base = dict(spec=StudySpec(), out=str(tmp_path / "o"))
    assert key(CONTEXT, base) == key(CONTEXT, {**base, "spec": StudySpec.of(shard_size=2, max_requests=7)})
    # the limit counts where pairing judges facts (it stops judging once the limit is reached), not elsewhere
    assert key(CONTEXT, base) != key(CONTEXT, {**base, "spec": StudySpec.of(limit=3)})
    unjudged = StudySpec.of(require_known=False, sweeps="resid")
    assert key(CONTEXT, {**base, "spec": unjudged}) == key(CONTEXT, {**base, "spec": unjudged.replace(limit=3)})
    assert key(CONTEXT, base) != key(CONTEXT, {**base, "spec": StudySpec.of(model="tiny-llama")})
    assert key(CONTEXT, base) != key(CONTEXT, {**base, "spec": StudySpec.of(seed=1)})
    # tracing needs the model's predictions even when pairs need not be known
    lax = StudySpec.of(require_known=False)
    assert key(CONTEXT, {**base, "spec": lax}) != key(CONTEXT, {**base, "spec": lax.replace(sweeps="resid,trace")})
    data = tmp_path / "facts.jsonl"
    data.write_text("a")
    one = key(CONTEXT, {**base, "spec": StudySpec.of(pairs=str(data))})
    data.write_text("b")  # an input counts by its content
    assert key(CONTEXT, {**base, "spec": StudySpec.of(pairs=str(data))}) != one
    engine = keyed_by(engine_inputs)
    assert engine(CONTEXT, base) == engine(CONTEXT, {**base, "spec": StudySpec.of(limit=3)})
    assert engine(CONTEXT, base) != engine(CONTEXT, {**base, "spec": StudySpec.of(backend="hf")})


def test_the_cache_key_is_the_cache_specification(tmp_path):
    """A bug this guards against: the cache task was keyed on a list of names that left out atp_kinds, so a
    rerun with more screened kinds found a cache that held too little."""
    key = keyed_by(cache_inputs)
    base = dict(spec=StudySpec.of(model="tiny-llama", sweeps="atp", atp_kinds="resid"), sweeps=("atp",),
                pairs=[], cache_root=str(tmp_path))
    wider = {**base, "spec": base["spec"].replace(atp_kinds="resid,heads,mlp_out")}
    assert cache_inputs(wider["spec"], ("atp",))["cache"] != cache_inputs(base["spec"], ("atp",))["cache"]
    assert key(CONTEXT, base) != key(CONTEXT, wider)
    # a setting the cache does not depend on leaves the key alone
    assert key(CONTEXT, base) == key(CONTEXT, {**base, "spec": base["spec"].replace(verify_top=3, limit=2)})
