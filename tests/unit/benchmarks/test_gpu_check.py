"""benchmarks/gpu_check.py, the check for a machine with a GPU, as far as a machine without one can
test it: its dry run on the CPU passes every check and prints them; it runs where vLLM (and the
warehouse and flow packages) cannot be imported; it refuses in one line where no CUDA device is;
and its comparison reports what differs.

The tests that run the script do so in processes of their own, loading models there: no fixture
says so, so they name their tier (engine: as heavy as an engine test)."""
from __future__ import annotations

import pytest
import torch

from benchmarks.gpu_check import Check, compare, guarded, max_abs_diff, table


def test_compare_reports_tensors_that_differ():
    ref = torch.zeros(3, 4)
    got = ref.clone()
    got[1, 2] = 2e-4
    check = compare("x", "cuda", ref, got, 1e-4)
    assert not check.ok and check.diff == pytest.approx(2e-4)
    assert compare("x", "cuda", ref, got, 3e-4).ok
    assert compare("x", "cuda", {"a": [ref, 1.0]}, {"a": [ref.clone(), 1.0]}, 0.0).ok


@pytest.mark.parametrize("ref, got", [
    (torch.zeros(3), torch.zeros(4)),  # another shape
    (torch.zeros(3), torch.tensor([0.0, float("nan"), 0.0])),  # not finite where the reference is
    (torch.tensor([float("inf")]), torch.tensor([float("-inf")])),
    ({"a": torch.zeros(1)}, {"b": torch.zeros(1)}),  # another structure
    ([torch.zeros(1)], [torch.zeros(1), torch.zeros(1)]),
    (None, torch.zeros(1)),
])
def test_compare_fails_what_cannot_be_compared(ref, got):
    assert max_abs_diff(ref, got) == float("inf")
    assert not compare("x", "cuda", ref, got, 1.0).ok


def test_a_part_that_stops_is_a_failed_check_and_the_table_says_fail(capsys):
    def part(model, device):
        raise RuntimeError("patchgrid worker: resid.1 writes a tensor on cpu into activations on cuda:0")

    [check] = guarded("worker tiny-llama", "cuda", part, "tiny-llama")
    assert not check.ok and "RuntimeError: patchgrid worker: resid.1 writes" in check.note
    assert "Traceback" in capsys.readouterr().err
    text = table([check, Check("hf tiny-llama: q", "cuda", 1e-6, 1e-4, True)])
    lines = text.splitlines()
    assert [c.strip() for c in lines[0].split(" | ")] == ["check", "device", "max abs diff", "tolerance", "result"]
    assert lines[2].endswith("FAIL") and lines[3].endswith("pass") and "1e-06" in lines[3]

