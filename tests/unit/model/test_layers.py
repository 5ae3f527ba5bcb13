"""`layers` and `positions` restrict every grid: each sweep kind's cells on a small model's
shape, the paths' senders and receivers, what atp estimates, the text the settings take, the check
against the model's layer count, and what a run records of them. No engine: the grids alone
(tests/process/flows/test_study_file.py runs a restricted study and reads its rows)."""
from __future__ import annotations

import pytest

from patchgrid.pipeline.spec import StudySpec
from patchgrid.settings import SpecError
from patchgrid.sweeps import SWEEP_KINDS, SweepConfig, SweepContext
from patchgrid.sweeps.base import check_layers
from tests.support.effect_rows import make_pair
from tests.support.reruns import identity_params

ROLES = ["before_subject", "subject_first", "subject_last", "further", "last"]
PAIR = make_pair("p", ROLES, subject=(1, 3))
# atp's grid is what it estimates (below); edges score the whole graph, and circuits are drawn on it,
# whatever the layers and positions
LAYERED = [name for name in SWEEP_KINDS if name not in ("atp", "embed", "edges", "circuit")]


def ctx(**settings) -> SweepContext:
    return SweepContext(SweepConfig(**settings), n_layers=4, n_heads=2, d_mlp=3)


@pytest.mark.parametrize("name", LAYERED)
def test_layers_restrict_each_kinds_grid(name):
    kind = SWEEP_KINDS[name]
    everything, restricted = ctx(trace_samples=1), ctx(trace_samples=1, layers="0,2-3")
    assert {c.layer for c in kind.cells(PAIR, everything) if c.site} == {0, 1, 2, 3}
    cells = kind.cells(PAIR, restricted)
    assert {c.layer for c in cells if c.site} == {0, 2, 3}, name
    assert kind.count(PAIR, restricted) == len(cells)  # the progress bar's total counts the same cells


def test_layers_leave_the_embedding_alone_and_restrict_what_atp_estimates():
    assert SWEEP_KINDS["embed"].cells(PAIR, ctx(layers="1")) == SWEEP_KINDS["embed"].cells(PAIR, ctx())
    atp = SWEEP_KINDS["atp"]
    grid = atp.grid(PAIR, ctx(sweeps="atp", atp_kinds="resid,heads", layers="1,3"))
    assert {c.layer for c in grid} == {1, 3} and {c.site for c in grid} == {"resid", "head"}


def test_layers_restrict_the_paths_senders_and_receivers_given_as_every_one():
    paths = SWEEP_KINDS["paths"]
    c = ctx(sweeps="paths", path_senders="heads,mlp_out,head.1.0", path_receivers="logits,heads", layers="0,2")
    senders = paths.senders(c)
    assert {layer for _, layer, _ in senders} == {0, 1, 2}  # head.1.0, named, is kept
    assert ("head", 1, 0) in senders and not any(layer == 1 and site == "mlp_out" for site, layer, _ in senders)
    assert {int(r.split(".")[1]) for r in paths.receivers(0, c) if r != "logits"} == {2}
    assert paths.count(PAIR, c) == len(paths.cells(PAIR, c))


@pytest.mark.parametrize("name", [*LAYERED, "embed"])
def test_positions_restrict_each_kinds_grid_and_a_shorter_prompt_leaves_some_out(name):
    kind = SWEEP_KINDS[name]
    cells = kind.cells(PAIR, ctx(trace_samples=1, positions="1,3-4,9"))  # the prompt has 5 positions
    # a knockout's query is the last position whatever the positions say (Geva et al.'s)
    assert {c.position for c in cells if c.site} == ({4} if name == "knockout" else {1, 3, 4}), name


@pytest.mark.parametrize("text, expected", [
    ("0-3,7", (0, 1, 2, 3, 7)), ("7, 0,0", (0, 7)), ([2, "0-1"], (0, 1, 2)), ((3,), (3,)), (5, (5,)),
])
def test_layers_are_numbers_and_ranges(text, expected):
    assert SweepConfig(layers=text).layers == expected
    assert SweepConfig(positions=text).positions == expected


@pytest.mark.parametrize("text, message", [
    ("a", "--layers 'a' is not a number nor a range a-b (e.g. 0,2,5 or 0-3,7)"),
    ("3-1", "--layers '3-1': numbers must not be negative and a range a-b must have a <= b"),
    ("-1", "--layers '-1' is not a number nor a range"),
    ([-2], "--layers '-2': numbers must not be negative"),
    (" , ", "--layers: no numbers given"),
    ("{x}", "--layers '{x}' is not a number"),
])
def test_bad_layers_are_refused_naming_the_flag(text, message):
    with pytest.raises(SpecError) as err:
        SweepConfig(layers=text)
    assert message in err.value.flag_message and "\n" not in err.value.flag_message


def test_a_layer_the_model_does_not_have_is_refused_with_its_count():
    with pytest.raises(SpecError) as err:
        check_layers(SweepConfig(layers="2,4"), 4, "tiny-llama")
    assert err.value.flag_message == "--layers 4: tiny-llama has 4 layers (0-3)"
    with pytest.raises(SpecError, match="layers 5: the model has 4 layers"):  # the grid itself refuses it
        SWEEP_KINDS["resid"].cells(PAIR, ctx(layers="5"))
    check_layers(SweepConfig(layers="0-3"), 4)


def test_layers_are_recorded_and_in_the_run_id_when_given_and_a_name_only_noted():
    plain, restricted = StudySpec(), StudySpec.of(layers="0,2", name="a label")
    assert "layers" not in identity_params(plain) and "layers" not in plain.recorded_params()
    assert identity_params(restricted)["layers"] == [0, 2]
    assert restricted.recorded_params()["name"] == "a label" and "name" not in identity_params(restricted)
    assert identity_params(StudySpec.of(layers="2,0")) == identity_params(StudySpec.of(layers=[0, 2]))


@pytest.mark.parametrize("label", ["", "two\nlines", "x" * 201])
def test_a_bad_name_is_refused(label):
    with pytest.raises(SpecError) as err:
        StudySpec(name=label)
    message = err.value.flag_message
    assert message.startswith("--name ") and message.endswith("a label is one line of 1 to 200 printable characters")
