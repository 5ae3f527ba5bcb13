"""Model folders: built-in test models, local folders, refusals."""
from __future__ import annotations

import json

import pytest

from patchgrid.model.models import BUILTIN, MANIFEST, ModelError, prepare, weights_hash


@pytest.mark.parametrize("name", [n for n in BUILTIN if n.startswith("tiny-")])
def test_tiny_models_build_once_and_load(name):
    from transformers import AutoConfig, AutoTokenizer

    folder = prepare(name)
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["weights_sha256"] == weights_hash(folder)
    assert prepare(name) == folder  # idempotent: found, not rebuilt
    assert AutoConfig.from_pretrained(folder).num_hidden_layers == 4
    assert AutoTokenizer.from_pretrained(folder)("The capital of France is")["input_ids"]


def test_tiny_models_are_deterministic(tmp_path, monkeypatch):
    monkeypatch.setenv("PATCHGRID_HOME", str(tmp_path))
    rebuilt = prepare("tiny-qwen3")
    monkeypatch.delenv("PATCHGRID_HOME")
    assert weights_hash(rebuilt) == weights_hash(prepare("tiny-qwen3"))


def test_local_folder_is_used_as_is():
    folder = prepare("tiny-llama")
    assert prepare(str(folder)) == folder


@pytest.mark.parametrize("name, message", [
    ("nonsense", "unknown model 'nonsense'"),
    ("./no/such/dir", "unknown model"),
])
def test_bad_names(name, message):
    with pytest.raises(ModelError, match=message):
        prepare(name)


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelError, match="has no config.json"):
        prepare(str(tmp_path))
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(ModelError, match="is a file"):
        prepare(str(tmp_path / "f.txt"))


@pytest.mark.slow
def test_smollm2_is_built_from_the_verified_gguf():
    folder = prepare("smollm2-135m")
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["source_sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    assert tok("The capital of France is")["input_ids"] == [504, 3575, 282, 4649, 314]
    assert tok.encode(" Paris", add_special_tokens=False) == [7042]
