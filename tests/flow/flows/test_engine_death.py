"""An engine that dies mid-sweep is rebuilt by the task's retry; the study completes, nothing missing.
(What a killed engine core does to the call waiting on it: tests/engine/backends/test_vllm_tensor_parallel.py.)"""
from __future__ import annotations

from patchgrid.pipeline.spec import StudySpec
from patchgrid.warehouse.loader import query
from tests.support.engines import needs_vllm
from tests.support.pairs import DATA

pytestmark = needs_vllm


class DyingEngine:
    """The real engine, which dies (as a crashed engine core would) on its n-th call."""

    def __init__(self, engine, die_on_call):
        self.engine, self.die_on_call, self.calls = engine, die_on_call, 0
        self.shape, self.folder, self.dtype = engine.shape, engine.folder, engine.dtype

    def run(self, requests, sources=None):
        self._call()
        return self.engine.run(requests, sources)

    def readings(self, requests, sources=None):
        self._call()
        return self.engine.readings(requests, sources)

    def _call(self):
        self.calls += 1
        if self.calls == self.die_on_call:
            self.engine.close()
            raise RuntimeError("EngineCore died unexpectedly")

    def close(self):
        self.engine.close()


def test_engine_death_is_retried_with_a_fresh_engine(prefect_api, tmp_path, monkeypatch):
    import patchgrid.backends.engine as engine_module
    from patchgrid.flows.study import study

    real = engine_module.load_engine
    built = []

    def load_engine(model, backend="vllm", **kw):
        engine = real(model, backend, **kw)
        # the first engine dies on its 3rd call: inside the sweeps, after the cache is built
        wrapped = DyingEngine(engine, die_on_call=3 if not built else 0)
        built.append(wrapped)
        return wrapped

    monkeypatch.setattr(engine_module, "load_engine", load_engine)
    common = dict(model="tiny-llama", pairs=str(DATA), sweeps="resid,mlp_out", limit=4, require_known=False,
                  shard_size=2)
    run_id = study(StudySpec.of(warehouse=str(tmp_path / "w.duckdb"), workdir=str(tmp_path / "work"), **common))
    assert len(built) == 2, "the retry did not start a fresh engine"
    monkeypatch.setattr(engine_module, "load_engine", real)
    ref_id = study(StudySpec.of(warehouse=str(tmp_path / "ref.duckdb"), workdir=str(tmp_path / "ref"), **common))
    assert run_id == ref_id
    sql = "SELECT pair_id, sweep, layer, position, patched_logit_diff FROM effects ORDER BY ALL"
    got, want = query(tmp_path / "w.duckdb", sql)[1], query(tmp_path / "ref.duckdb", sql)[1]
    assert len(got) == len(want) > 0
    assert got == want
