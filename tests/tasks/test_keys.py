"""Task cache keys: the same inputs give the same key, before and after the task wrote its output."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from patchgrid.engine import EnginePool
from patchgrid.spec import StudySpec
from patchgrid.tasks.keys import keyed_on

CONTEXT = SimpleNamespace(task=SimpleNamespace(name="align_pairs"))


def test_an_output_counts_by_its_path_not_by_what_is_there(tmp_path):
    """The cause of a rerun that recomputed align_pairs: its `out` file, once written, changed the key."""
    key = keyed_on("model", "pairs")
    out = tmp_path / "pairs.parquet"
    params = dict(spec=StudySpec(), model_sha256="abc", out=str(out), engines=EnginePool())
    before = key(CONTEXT, params)
    out.write_bytes(b"the table")
    assert key(CONTEXT, params) == before
    assert key(CONTEXT, {**params, "out": str(tmp_path / "elsewhere.parquet")}) != before


def test_only_the_named_spec_fields_count(tmp_path):
    key = keyed_on("model", "pairs")
    base = dict(spec=StudySpec(), out=str(tmp_path / "o"))
    assert key(CONTEXT, base) == key(CONTEXT, {**base, "spec": StudySpec(limit=3, shard_size=2)})
    assert key(CONTEXT, base) != key(CONTEXT, {**base, "spec": StudySpec(model="tiny-llama")})
    data = tmp_path / "facts.jsonl"
    data.write_text("a")
    one = key(CONTEXT, {**base, "spec": StudySpec(pairs=str(data))})
    data.write_text("b")  # an input counts by its content
    assert key(CONTEXT, {**base, "spec": StudySpec(pairs=str(data))}) != one
    with pytest.raises(ValueError, match="no field 'colour'"):
        keyed_on("colour")
