"""patchgrid/runtime/machine.py: the dtype a benchmark runs in by default. On a CPU without bf16 units
(no AMX, no AVX-512 BF16) torch emulates bf16 matrix work, and a benchmark at its defaults would
run for far longer than it says; there it runs float32 and says why."""
from __future__ import annotations

from patchgrid.runtime.machine import bf16_units, machine_dtype

NO_BF16 = {"avx2", "avx512f", "fma"}


def test_a_cpu_without_bf16_units_runs_float32_and_says_so():
    dtype, why = machine_dtype(None, flags=NO_BF16, gpu=False)
    assert dtype == "float32" and "no bf16 units" in why
    assert not bf16_units(NO_BF16)


def test_bf16_units_or_a_gpu_keep_the_models_own_dtype():
    for flags in (NO_BF16 | {"avx512_bf16"}, NO_BF16 | {"amx_bf16", "amx_tile"}):
        assert bf16_units(flags)
        assert machine_dtype(None, flags=flags, gpu=False) == ("auto", "the model's own dtype")
    assert machine_dtype(None, flags=NO_BF16, gpu=True)[0] == "auto"


def test_a_dtype_asked_for_is_kept():
    assert machine_dtype("bfloat16", flags=NO_BF16, gpu=False) == ("bfloat16", "as asked (--dtype)")
    assert machine_dtype("float32", flags=NO_BF16 | {"avx512_bf16"}, gpu=False)[0] == "float32"
