"""The clean-activation cache: captured once, keyed, written atomically, read memory-mapped."""
from __future__ import annotations

import pytest
import torch

from patchgrid.cache import ActivationCache, CacheSpec, layer_keys, load_or_build
from patchgrid.plan import Request
from tests.support.engines import needs_vllm
from tests.support.pairs import shipped_pairs

MODEL = "tiny-llama"


class Counting:
    """An engine wrapper that counts forwards, to prove a cache hit runs none."""

    def __init__(self, engine, fail_on_call=None):
        self.engine, self.requests, self.calls, self.fail_on_call = engine, 0, 0, fail_on_call
        self.shape, self.folder, self.dtype = engine.shape, engine.folder, engine.dtype

    def run(self, requests, sources=None):
        self._count(requests)
        return self.engine.run(requests, sources)

    def readings(self, requests, sources=None):
        self._count(requests)
        return self.engine.readings(requests, sources)

    def _count(self, requests):
        self.calls += 1
        if self.fail_on_call == self.calls:
            raise RuntimeError("engine died")
        self.requests += len(requests)


@pytest.fixture(scope="module")
def pairs(tokenizers):
    return shipped_pairs(tokenizers(MODEL), 5)


def spec(n_layers=4):
    return CacheSpec(layer_keys("resid", n_layers) + layer_keys("head", n_layers) + ("embed",), ("clean", "corrupt"))


@pytest.mark.parametrize("backend", [pytest.param("vllm", marks=needs_vllm), "hf"])
def test_built_once_then_found_without_a_forward(tmp_path, engines, pairs, backend):
    engine = Counting(engines.get(MODEL, backend, dtype="float32"))
    cache, built = load_or_build(engine, pairs, spec(), tmp_path, batch_pairs=2, log=lambda *_: None)
    assert built and engine.calls == 3  # 5 pairs in batches of 2
    again, built = load_or_build(engine, pairs, spec(), tmp_path, log=lambda *_: None)
    assert not built and engine.calls == 3 and again.folder == cache.folder
    # a sweep needing fewer sites reuses the larger data set
    smaller = CacheSpec(layer_keys("resid", 4), ("clean",))
    reused, built = load_or_build(engine, pairs, smaller, tmp_path, log=lambda *_: None)
    assert not built and reused.folder == cache.folder


def test_values_and_baselines_match_the_engine(tmp_path, engines, pairs):
    engine = engines.get(MODEL, "hf", dtype="float32")
    cache, _ = load_or_build(engine, pairs, spec(), tmp_path, log=lambda *_: None)
    for p in pairs:
        ans = (p.clean_answer_id, p.corrupt_answer_id)
        c, k = engine.run([Request(tokens=p.clean_ids, answers=ans, capture=spec().keys),
                           Request(tokens=p.corrupt_ids, answers=ans, capture=spec().keys)])
        for key in spec().keys:
            assert torch.equal(cache.captures(p.pair_id, "clean")[key], c.captures[key])
            assert torch.equal(cache.captures(p.pair_id, "corrupt")[key], k.captures[key])
        base = cache.baselines[p.pair_id]
        assert base["clean_logit_diff"] == pytest.approx(float(c.answer_logits[0] - c.answer_logits[1]), abs=1e-5)
        assert base["corrupt_p"] == pytest.approx(float(k.answer_probs[0]), abs=1e-6)
    assert cache.bytes_per_pair > 0


def test_bfloat16_round_trips_and_reads_are_views(tmp_path, engines, pairs):
    engine = engines.get(MODEL, "hf", dtype="bfloat16")
    keys = CacheSpec(layer_keys("resid", 4), ("clean",))
    cache, _ = load_or_build(engine, pairs, keys, tmp_path, log=lambda *_: None)
    assert cache.manifest["dtype"] == "bfloat16"
    p = pairs[0]
    direct = engine.run([Request(tokens=p.clean_ids, answers=(1,), capture=keys.keys)])[0].captures
    a = cache.captures(p.pair_id)["resid.2"]
    assert a.dtype == torch.bfloat16 and torch.equal(a, direct["resid.2"])
    # memory-mapped: reading twice gives views of the same bytes, not copies
    assert cache.captures(p.pair_id)["resid.2"].data_ptr() == a.data_ptr()


def test_a_changed_model_or_pair_set_misses(tmp_path, engines, pairs, tokenizers):
    hf = engines.get(MODEL, "hf", dtype="float32")
    first, _ = load_or_build(hf, pairs, spec(), tmp_path, log=lambda *_: None)
    fewer, built = load_or_build(hf, pairs[:3], spec(), tmp_path, log=lambda *_: None)
    assert built and fewer.folder != first.folder
    qwen = engines.get("tiny-qwen3", "hf", dtype="float32")
    other, built = load_or_build(qwen, shipped_pairs(tokenizers("tiny-qwen3"), 3), spec(), tmp_path,
                                 log=lambda *_: None)
    assert built and other.folder not in (first.folder, fewer.folder)


def test_a_crash_mid_write_leaves_nothing_that_looks_complete(tmp_path, engines, pairs):
    engine = Counting(engines.get(MODEL, "hf", dtype="float32"), fail_on_call=2)
    with pytest.raises(RuntimeError, match="engine died"):
        load_or_build(engine, pairs, spec(), tmp_path, batch_pairs=2, log=lambda *_: None)
    assert list(tmp_path.iterdir()) == []
    # a folder without its manifest (as a kill -9 before the rename would leave) is never used
    (tmp_path / "deadbeef").mkdir()
    (tmp_path / "deadbeef" / "clean.arrow").write_bytes(b"partial")
    engine = Counting(engines.get(MODEL, "hf", dtype="float32"))
    cache, built = load_or_build(engine, pairs, spec(), tmp_path, log=lambda *_: None)
    assert built and isinstance(cache, ActivationCache) and cache.folder.name != "deadbeef"


def test_a_missing_run_or_site_is_named(tmp_path, engines, pairs):
    """A sweep that reads what the cache was not built with gets an error naming it, not a KeyError."""
    from patchgrid.cache import CacheError

    engine = engines.get(MODEL, "hf", dtype="float32")
    cache, _ = load_or_build(engine, pairs, CacheSpec(layer_keys("resid", 4), ("clean",)), tmp_path,
                             log=lambda *_: None)
    with pytest.raises(CacheError, match="holds no corrupt run"):
        cache.captures(pairs[0].pair_id, "corrupt")
    with pytest.raises(CacheError, match="holds no head.0"):
        cache.captures(pairs[0].pair_id, "clean", ["head.0"])
    with pytest.raises(CacheError, match="holds no pair 'nope'"):
        cache.captures("nope")


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_data_set_is_found_discarded_and_rebuilt(tmp_path, engines, pairs, damage):
    from patchgrid.cache import damage as damage_of

    engine = Counting(engines.get(MODEL, "hf", dtype="float32"))
    cache, _ = load_or_build(engine, pairs, spec(), tmp_path, log=lambda *_: None)
    want = {p.pair_id: cache.captures(p.pair_id, "corrupt")["resid.2"].clone() for p in pairs}
    path = cache.folder / "corrupt.arrow"
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 3] ^= 0x01
    path.write_bytes(bytes(data))
    assert "corrupt.arrow" in damage_of(cache.folder)
    logged = []
    again, built = load_or_build(engine, pairs, spec(), tmp_path, log=logged.append)
    assert built and any("is damaged" in line and "corrupt.arrow" in line for line in logged)
    assert damage_of(again.folder) is None
    for p in pairs:
        assert torch.equal(again.captures(p.pair_id, "corrupt")["resid.2"], want[p.pair_id])


def test_a_sound_data_set_is_checked_by_its_stats_and_a_flip_is_still_found(tmp_path, engines, pairs):
    """Each file's stat is recorded with its sha256 (at the build, or at the first check once the
    file has settled); a file whose stat still matches is not read, and a byte flipped in place,
    its mtime set back, is still found (its ctime moved)."""
    import json
    import os
    import time

    from patchgrid.cache import damage
    from patchgrid.model.models import file_stat

    engine = Counting(engines.get(MODEL, "hf", dtype="float32"))
    cache, _ = load_or_build(engine, pairs, spec(), tmp_path, log=lambda *_: None)
    manifest = json.loads((cache.folder / "manifest.json").read_text())
    assert set(manifest["stats"]) <= set(manifest["files"])
    assert all(stat == file_stat(cache.folder / name) for name, stat in manifest["stats"].items())
    past = time.time() - 3600  # as files written more than a moment ago
    for name in manifest["files"]:
        os.utime(cache.folder / name, (past, past))
    assert damage(cache.folder) is None
    stats = json.loads((cache.folder / "manifest.json").read_text())["stats"]
    assert stats == {name: file_stat(cache.folder / name) for name in manifest["files"]}
    again, built = load_or_build(engine, pairs, spec(), tmp_path, log=lambda *_: None)
    assert not built and again.folder == cache.folder
    path = cache.folder / "clean.arrow"
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    os.utime(path, (past, past))
    assert damage(cache.folder) == "clean.arrow does not match its sha256"
    logged = []
    rebuilt, built = load_or_build(engine, pairs, spec(), tmp_path, log=logged.append)
    assert built and any("is damaged" in line and "clean.arrow" in line for line in logged)
