"""One command-line vocabulary: one flag per setting with its declared default in every
command, every default in --help, --verbose everywhere, a setting that cannot apply refused in one
line, answers tokenised by the data sets' rule with a warning for one of several tokens, and a model
folder transformers refuses named with transformers' reason."""
from __future__ import annotations

import json

from patchgrid.cli import main
from tests.support.processes import cli_here as cli
from tests.support.processes import one_line_error

PAIR = ["--clean", "The capital of France is", "--corrupt", "The capital of Spain is"]


def test_answers_on_the_command_line_are_tokenised_as_a_data_sets_and_a_split_one_is_warned(capsys):
    """`Paris` after a prompt is ` Paris`, as in a pairs file; `Abuja` is five tokens of tiny-llama's
    tokenizer: one warning line names them and says how the answer is scored."""
    common = ["patch", "--model", "tiny-llama", *PAIR, "--site", "resid", "--position", "4", "--backend", "hf",
              "--json"]
    typed = cli(*common, "--clean-answer", "Paris", "--corrupt-answer", "Abuja")
    assert typed.returncode == 0, typed.stderr
    warnings = [line for line in typed.stderr.splitlines() if line.startswith("patchgrid: warning:")]
    assert warnings == ["patchgrid: warning: --corrupt-answer 'Abuja' is 5 tokens [' A', 'b', 'u', 'j', 'a']: "
                        "scored whole after the prompt (teacher-forced), on the log-probability difference "
                        "(logprob_diff) rather than the logit difference of one token"], typed.stderr
    assert main([*common, "--clean-answer", " Paris", "--corrupt-answer", " Abuja"]) == 0
    spaced = capsys.readouterr()
    assert json.loads(typed.stdout) == json.loads(spaced.out)
    assert json.loads(spaced.out)["baseline"]["metric"] == "logprob_diff"
    assert main([*common, "--clean-answer", "Paris", "--corrupt-answer", "Madrid"]) == 0  # one token each
    one_token = capsys.readouterr()
    assert "warning" not in one_token.err and json.loads(one_token.out)["baseline"]["metric"] == "logit_diff"


def test_a_model_folder_transformers_refuses_is_one_line_with_its_reason(tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 130, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 256, "vocab_size": 512}))
    res = cli("patch", "--model", str(folder), *PAIR, "--clean-answer", "Paris", "--corrupt-answer", "Madrid",
              "--site", "resid", "--backend", "hf")
    one_line_error(res, f"model folder {str(folder)!r}: transformers cannot read its config.json: The hidden size "
                        "(130) is not a multiple of the number of attention heads (4).")
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr

