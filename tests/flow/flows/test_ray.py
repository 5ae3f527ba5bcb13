"""Studies on a multi-node Ray cluster on this machine (Ray's own ray.cluster_utils.Cluster): a head
node with no engine resources, where the flow runs, and two worker nodes that declare two logical
GPUs each. Every stage that touches the model runs in the engine actors; the warehouse holds exactly
what a local run gives, also when an actor's process is killed and a worker node dies mid-study;
tensor-parallel vLLM engines serve every stage; an actor whose work failed starts a fresh engine; no
actor of a run outlives it. (The expensive cases run once each: the study with its faults, and the
tensor-parallel study. The study with its faults goes last: it removes a worker node, which a later
test would go without. It runs on hf engines: what it proves is Ray's side, the same whatever the
actors run, and a vLLM engine's start in an actor costs three imports of vLLM, one per process, where
an hf engine's costs none. What a vLLM engine core's death does to the call waiting on it is checked
where the engine is: tests/engine/backends/test_vllm_tensor_parallel.py.)"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import duckdb
import pytest

from patchgrid.pipeline.spec import StudySpec
from tests.support.engines import needs_vllm
from tests.support.pairs import DATA
from tests.support.processes import tables
from tests.support.workers import all_cores

pytestmark = needs_vllm
ray = pytest.importorskip("ray", reason="Ray is not installed (make install brings it)")

# resid and heads on the accepted pairs; trace on the facts the model knows alone (so pairing asks
# the model); atp takes gradients too: every kind of model work
COMMON = dict(model="tiny-llama", pairs=str(DATA), sweeps="resid,heads,trace,atp", limit=5, require_known=False,
              trace_samples=2, atp_kinds="resid", verify_top=2, verify_random=1, shard_size=1, backend="hf")
WORKER_NODE = dict(num_cpus=1, num_gpus=2)


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    # each engine's KV cache: 1 GiB (patchgrid's CPU default is 2), so that four engines fit here
    old = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    # Ray runs its workers (the engine actors and the processes their engines start) at niceness 15: beside the
    # other test worker's busy core they got a few per cent of a CPU (a tensor-parallel rank once took ten
    # minutes to start). Here they run at the tests' own priority.
    with all_cores():  # the nodes' processes keep them: a tensor-parallel actor's ranks get a core each
        c = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, num_gpus=0, include_dashboard=False,
                                                               object_store_memory=200 * 1024 * 1024,
                                                               _system_config={"worker_niceness": 0}))
        workers = [c.add_node(**WORKER_NODE, object_store_memory=200 * 1024 * 1024) for _ in range(2)]
        c.wait_for_nodes()
    try:
        yield c, workers
    finally:
        c.shutdown()
        if old is None:
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        else:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = old


@pytest.fixture(scope="module")
def local_run(prefect_api, tmp_path_factory):
    from patchgrid.flows.study import study

    tmp = tmp_path_factory.mktemp("local")
    study(StudySpec.of(warehouse=str(tmp / "local.duckdb"), workdir=str(tmp / "work"), **COMMON))
    return tmp / "local.duckdb"


def _ray_spec(cluster, tmp: Path, **extra) -> StudySpec:
    c, _ = cluster
    return StudySpec.of(warehouse=str(tmp / "ray.duckdb"), workdir=str(tmp / "work"), runner="ray",
                        ray_address=c.address, ray_workers=3, **COMMON, **extra)


def _alive_actors(cluster) -> list[str]:
    """Named actors of patchgrid still alive on the cluster, asked from a connection of our own."""
    c, _ = cluster
    ray.init(address=c.address, namespace="patchgrid")
    try:
        return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("patchgrid-")]
    finally:
        ray.shutdown()


def _provenance(work: Path) -> list[dict]:
    """Which actor served each shard of the runs in the work folder `work`."""
    return [json.loads(p.read_text()) for p in sorted(work.glob("runs/*/effects/*.engine.json"))]


def _same_data(got: Path, want: Path) -> None:
    """The warehouses hold the same data: every exact number equal to the last bit; attribution
    patching's estimates (gradients, whose float32 sums depend on the process's thread count) within
    1e-6 (their largest here: about 2)."""
    a, b = tables(got), tables(want)
    for table in ("pairs", "baselines"):
        assert a[table] == b[table], f"{table} differs between the Ray and the local run"
    exact_a, est_a = _effects(got)
    exact_b, est_b = _effects(want)
    assert len(exact_a) == len(exact_b) > 300, f"effects: {len(exact_a)} rows on Ray, {len(exact_b)} here"
    differ = [(x, y) for x, y in zip(exact_a, exact_b) if x != y]
    assert not differ, f"effects: {len(differ)} rows differ on Ray and locally; the first: {differ[0]}"
    assert est_a.keys() == est_b.keys()
    for key, value in est_a.items():
        assert value == pytest.approx(est_b[key], rel=1e-5, abs=1e-6), key


def _effects(warehouse: Path) -> tuple[list, dict]:
    con = duckdb.connect(str(warehouse), read_only=True)
    try:
        exact = sorted(con.execute("SELECT * EXCLUDE (run_id, estimate, estimate_graddrop) FROM effects").fetchall(),
                       key=repr)
        keyed = con.execute('SELECT pair_id, sweep, site, direction, layer, position, head, neuron, "window", sender, '
                            "receiver, metric, estimate FROM effects WHERE estimate IS NOT NULL").fetchall()
    finally:
        con.close()
    return exact, {row[:-1]: row[-1] for row in keyed}


def test_actors_ask_for_gpus_and_see_only_their_own(cluster):
    from patchgrid.backends.cluster import RayEngines

    c, _ = cluster
    with RayEngines("run-devices", "tiny-llama", "0" * 64, "vllm", "test", workers=3, address=c.address,
                    timeout_s=120) as engines:
        assert engines.gpus == 1.0  # the cluster has GPUs: one per engine by default
        where = engines.where()
        # at the tests' own priority, not Ray's niceness 15 for its workers (the cluster fixture)
        assert {os.getpriority(os.PRIO_PROCESS, w["pid"]) for w in where} == {os.getpriority(os.PRIO_PROCESS, 0)}
    by_node: dict[str, list[str]] = {}
    for w in where:
        by_node.setdefault(w["node_id"], []).append(w["cuda_visible_devices"])
    assert c.head_node.node_id not in by_node, "an engine actor landed on the head node, which has no GPU"
    shared = [devices for devices in by_node.values() if len(devices) > 1]
    assert shared, f"three actors on two nodes: two must share one ({where})"
    for devices in shared:
        assert None not in devices and len(set(devices)) == len(devices), f"actors on one node share a GPU: {where}"
    assert _alive_actors(cluster) == []


def _slow(seconds, *, engine):
    time.sleep(seconds)
    return engine.shape.n_layers


def _failing(*, engine):
    raise RuntimeError("this engine's work failed")


# The bound on every wait of the test below but its stuck call: several times what an actor's start or an hf
# engine's start (the longest of its waits) takes on a 2-core machine (3 s; once over 20 s with three test
# processes sharing the two cores).
STUCK_TIMEOUT_S = 30
# The stuck call's own bound, which it waits out: its actor has started and its engine answered already, so
# nothing but the stuck work itself takes this long.
STUCK_CALL_TIMEOUT_S = 5


def test_a_stuck_call_times_out_and_a_failed_engine_is_replaced(cluster, tmp_path):
    """Every wait on Ray is bounded: a call past timeout_s kills its actor, which a new one replaces;
    a work that fails leaves its actor standing, and the actor's next work starts a fresh engine."""
    from ray import cloudpickle

    import tests.flow.flows.test_ray as this
    from patchgrid.backends.cluster import RayEngines
    from patchgrid.backends.engine import using_engine

    cloudpickle.register_pickle_by_value(this)  # the works below cross to the actors by value
    c, _ = cluster
    try:
        with pytest.raises(RuntimeError, match="the caller's own error"):
            with RayEngines("run-faults", "tiny-llama", "0" * 64, "hf", "test", workers=1, address=c.address,
                            timeout_s=STUCK_TIMEOUT_S) as engines:
                layers = engines.run(using_engine(_slow, 0))
                assert layers > 0
                engines.timeout_s = STUCK_CALL_TIMEOUT_S
                with pytest.raises(TimeoutError, match=f"ray_timeout_s {STUCK_CALL_TIMEOUT_S} s"):
                    engines.run(using_engine(_slow, 60))
                engines.timeout_s = STUCK_TIMEOUT_S  # the replacement's start, and the calls after
                assert engines.names()[0].endswith("-0.2"), "the stuck actor was not replaced"
                with pytest.raises(RuntimeError, match="this engine's work failed"):
                    engines.run(using_engine(_failing))
                record = tmp_path / "engine.json"
                assert engines.run(using_engine(_slow, 0), provenance=str(record)) == layers
                served = json.loads(record.read_text())
                assert served["actor"].endswith("-0.2") and served["engine_starts"] == 2
                raise RuntimeError("the caller's own error")  # a run that fails releases its actors too
    finally:
        cloudpickle.unregister_pickle_by_value(this)
    assert _alive_actors(cluster) == []


TP = dict(model="tiny-llama", pairs=str(DATA), sweeps="resid,trace", limit=2, require_known=False, trace_samples=2,
          shard_size=1)


def test_tensor_parallel_engines_serve_every_stage(cluster, prefect_api, tmp_path):
    """Pairing that asks the model, the cache and the sweeps, each on a tensor_parallel_size=2 engine
    (two ranks, two GPUs per actor): the same pairs and the numbers of one rank within float32's
    reordered sums."""
    from patchgrid.flows.study import study
    from patchgrid.runtime.progress import reporting_to

    c, _ = cluster
    study(StudySpec.of(warehouse=str(tmp_path / "one.duckdb"), workdir=str(tmp_path / "one"), **TP))
    told = []
    with reporting_to(lambda stage, done, total, note: told.append((stage, done, total))):
        study(StudySpec.of(warehouse=str(tmp_path / "tp.duckdb"), workdir=str(tmp_path / "tp"), runner="ray",
                           ray_address=c.address, ray_workers=1, tensor_parallel_size=2, **TP))
    shards = [(done, total) for stage, done, total in told if stage == "shards on Ray"]
    assert shards and shards[0][0] == 0 and shards[-1][0] == shards[-1][1] > 1, f"shards' progress: {shards}"
    assert [d for d, _ in shards] == sorted(d for d, _ in shards), "shards done counted down"
    served = _provenance(tmp_path / "tp")
    a, b = tables(tmp_path / "tp.duckdb"), tables(tmp_path / "one.duckdb")
    assert a["pairs"] == b["pairs"]
    sql = ("SELECT pair_id, sweep, site, layer, position, \"window\", metric, patched_logprob_diff, patched_p "
           "FROM effects ORDER BY ALL")
    got, want = (duckdb.connect(str(p), read_only=True).execute(sql).fetchall()
                 for p in (tmp_path / "tp.duckdb", tmp_path / "one.duckdb"))
    assert len(got) == len(want) > 50
    for x, y in zip(got, want):
        assert x[:7] == y[:7]
        assert x[7:] == pytest.approx(y[7:], abs=1e-4), x[:7]
    assert served and all(s["cuda_visible_devices"].count(",") == 1 for s in served)  # two GPUs each
    assert _alive_actors(cluster) == []


def test_a_sigterm_cancels_a_study_on_ray_and_leaves_no_actor(cluster, prefect_api, tmp_path):
    """ray.init sets a SIGTERM handler of its own (sys.exit) in the process that connects, the study's: the
    study's own handler stays, so a SIGTERM mid-study (what Slurm and Kubernetes send) cancels it, the run is
    recorded as cancelled, not failed, and its actors are killed. (On hf engines: the handlers are the
    connecting process's, whatever the actors hold; a vLLM engine's start in an actor costs three imports of
    vLLM, one per process.)"""
    from patchgrid.flows.study import study
    from patchgrid.runtime.progress import reporting_to
    from patchgrid.runtime.stopping import Cancelled
    from patchgrid.warehouse.loader import query

    c, _ = cluster
    sent = []

    def on_progress(stage, done, total, note):
        if stage == "shards on Ray" and not sent:  # Ray connected, its actors started
            sent.append(done)
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    warehouse = tmp_path / "stopped.duckdb"
    with reporting_to(on_progress), pytest.raises(Cancelled):
        study(StudySpec.of(warehouse=str(warehouse), workdir=str(tmp_path / "work"), runner="ray",
                           ray_address=c.address, ray_workers=1, **{**TP, "backend": "hf"}))
    assert sent, "the study never reached its shards"
    assert query(warehouse, "SELECT status, reason FROM runs")[1] == [("cancelled", "cancelled by SIGTERM")]
    assert signal.getsignal(signal.SIGTERM) is before
    assert _alive_actors(cluster) == []


class ActorAndNodeDie(threading.Thread):
    """Mid-study, from a thread of the test, as shards complete (each shard's provenance, the actor that
    served it, is written as it ends): one actor's process is killed, then the worker node of another
    actor that has served a shard is removed (Ray's Cluster.remove_node: every process on it dies)."""

    def __init__(self, cluster, work: Path):
        super().__init__(daemon=True)
        self.c, self.workers = cluster
        self.work, self.done, self.error = work, [], None
        self.stop = threading.Event()

    def served(self) -> list[dict]:
        return _provenance(self.work)

    def wait_until(self, found):
        """The first non-None `found(served)`, as shards complete."""
        while not self.stop.is_set():
            got = found(self.served())
            if got is not None:
                return got
            time.sleep(0.1)
        raise RuntimeError("the study ended first")

    def run(self):
        try:
            self.inject()
        except BaseException as exc:  # reported by the test
            self.error = exc

    def inject(self):
        victim = self.wait_until(lambda served: next((s for s in reversed(served) if _alive(s["pid"])), None))
        os.kill(victim["pid"], signal.SIGKILL)
        self.done.append(("actor", victim["actor"], len(self.served())))
        # at once, while shards remain (waiting for a later shard could take until the last one on a busy
        # machine): the node of the latest other actor that served a shard and is alive
        hit = self.wait_until(lambda served: next(
            (s for s in reversed(served) if s["actor"] != victim["actor"] and _alive(s["pid"])), None))
        node = next(n for n in self.workers if n.node_id == hit["node_id"])
        self.c.remove_node(node)
        self.done.append(("node", node.node_id, len(self.served())))

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, kind, value, tb):
        self.stop.set()
        self.join(timeout=60)
        if kind is None:  # the study's own error, if any, is the one to see
            assert self.error is None, f"a fault could not be injected: {self.error!r}"


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def test_a_study_on_the_cluster_survives_a_killed_actor_and_a_dead_node(cluster, local_run, prefect_api, tmp_path,
                                                                       monkeypatch):
    """The flow runs with model loading refused in its own process: every stage's model work runs in
    the actors; the faults cost only the shards they hit."""
    import transformers

    import patchgrid.backends.engine as engine_module
    from patchgrid.flows.study import study

    def refuse(*args, **kwargs):
        raise AssertionError("the flow's own process loaded a model")

    monkeypatch.setattr(engine_module, "load_engine", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    with ActorAndNodeDie(cluster, tmp_path / "work") as faults:
        study(_ray_spec(cluster, tmp_path))
    served = _provenance(tmp_path / "work")
    assert [kind for kind, _, _ in faults.done] == ["actor", "node"]
    assert all(at < len(served) for _, _, at in faults.done), f"a fault came after the last shard: {faults.done}"
    _same_data(tmp_path / "ray.duckdb", local_run)
    assert all(s["cuda_visible_devices"] is not None for s in served)
    assert _alive_actors(cluster) == [], "the run's actors outlived it"
