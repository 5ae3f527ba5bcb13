"""Commands that load a model on the Hugging Face backend, run in this process (`patchgrid.cli.main`):
the tables and JSON they print, and the bad input they can only refuse once the model's shape is known
(a layer, head or path end outside the model, a site the family lacks), with exit 2 and one line. The
refusals before any model loads: tests/unit/cli/test_refusals.py; the same code and line from a command
run as a process: tests/process/cli/test_refusal_in_a_process.py; `patch` and `attention` on vLLM against
hf, `pairs check` and `sweep`: tests/engine/cli/test_model_commands.py."""
from __future__ import annotations

import json

import pytest

from patchgrid.cli import main

PAIR = ["--clean", "The capital of France is", "--corrupt", "The capital of Spain is",
        "--clean-answer", " Paris", "--corrupt-answer", " Madrid"]


def ran(args, capsys) -> str:
    """`patchgrid ARGS` run here to exit 0: what it printed on stdout."""
    code = main(list(args))
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


def refused(args, capsys) -> str:
    """`patchgrid ARGS` run here: refused with exit 2 and one `patchgrid: error:` line, no traceback; that line."""
    code = main(list(args))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("patchgrid: error:"), err
    return last


def test_patch_heads_table(capsys):
    out = ran(["patch", "--model", "tiny-gpt2", *PAIR, "--site", "head", "--position", "3", "--backend", "hf"], capsys)
    assert "baseline logit difference" in out
    assert "3.2" in out  # layer 3, head 2 row


def test_paths_table_and_json(capsys):
    args = ["paths", "--model", "tiny-llama", *PAIR, "--path-senders", "heads,mlp_out.0",
            "--path-receivers", "logits,head.3.1", "--backend", "hf"]
    out = ran([*args, "--top", "5"], capsys)
    assert "paths that move logit_diff most (direct paths: MLPs after the sender frozen)" in out
    assert "(5 rows)" in out
    data = json.loads(ran([*args, "--json", "--path-mlps", "recomputed"], capsys))
    assert data["mlps"] == "recomputed"
    ends = {(e["sender"], e["receiver"]) for e in data["effects"]}
    # senders below layer 3 reach head 3.1's q (head 1) and k, v (key/value head 0); all reach the logits
    assert ("head.2.0", "q.3.1") in ends and ("mlp_out.0", "v.3.0") in ends and ("head.3.1", "logits") in ends
    assert ("head.3.0", "q.3.1") not in ends
    assert {e["position"] for e in data["effects"]} == {None, 3, 4}  # all at once, subject's last, last


def test_a_path_end_outside_the_model_is_one_clear_line(capsys):
    line = refused(["paths", "--model", "tiny-llama", *PAIR, "--path-receivers", "head.9.0", "--backend", "hf"], capsys)
    assert "path end 'head.9.0' is outside the model" in line


def test_a_site_the_family_lacks_is_one_clear_line(capsys):
    """Refused once the engine has started (patchgrid.pipeline.one_pair.sweep_pair reads the family from its shape)."""
    line = refused(["patch", "--model", "tiny-gptj", *PAIR, "--site", "resid_mid", "--backend", "hf"], capsys)
    assert line == ("patchgrid: error: --site resid_mid: the gptj block is parallel: attention and MLP both read "
                    "the layer's input (resid_pre), so no stream exists between them")


@pytest.mark.parametrize("args, message", [
    (["--layers", "9"], "--layers 9: the model has 4 layers (0-3)"),
    (["--heads", "0-99"], "--heads 4: the model has 4 heads (0-3)"),
])
def test_attention_outside_the_model_is_one_clear_line(args, message, capsys):
    """--layers that are not numbers are refused before the model loads (tests/unit/cli/test_refusals.py)."""
    line = refused(["attention", "--model", "tiny-llama", "--text", "The capital of France is", "--backend", "hf",
                    *args], capsys)
    assert message in line
