"""What machine this is, printed beside a benchmark's figures: speed ratios differ between CPUs,
most of all between those with AMX (bf16 matrix tiles), with only AVX-512 BF16, and with neither."""
from __future__ import annotations

import os
import platform


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cpu_flags() -> set[str]:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def machine() -> str:
    """One line: CPU model, cores, and the bf16 matrix features that decide how fast it multiplies."""
    flags = cpu_flags()
    amx = "yes" if "amx_bf16" in flags else "no"
    avx = "yes" if "avx512_bf16" in flags else "no"
    line = f"CPU {cpu_model()}, {len(os.sched_getaffinity(0))} cores, AMX {amx}, AVX-512 BF16 {avx}"
    try:
        import torch

        if torch.cuda.is_available():
            line += f"; GPU {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return line


def bf16_units(flags: set[str] | None = None) -> bool:
    """Whether this CPU multiplies bf16 in hardware (AMX or AVX-512 BF16); without either, torch
    emulates bf16 matrix work, many times slower than float32."""
    flags = cpu_flags() if flags is None else flags
    return bool({"amx_bf16", "avx512_bf16"} & flags)


def machine_dtype(requested: str | None, flags: set[str] | None = None, gpu: bool | None = None) -> tuple[str, str]:
    """(the dtype a benchmark runs the model in, why): the one asked for (--dtype); else the model's
    own ("auto": bf16 for smollm2-135m) on a GPU or a CPU with bf16 units, and float32 on a CPU
    without them, where bf16 is emulated (engine_throughput.py at its defaults did not finish in 25
    minutes on such a machine)."""
    if requested:
        return requested, "as asked (--dtype)"
    if gpu is None:
        try:
            import torch

            gpu = torch.cuda.is_available()
        except ImportError:
            gpu = False
    if gpu or bf16_units(flags):
        return "auto", "the model's own dtype"
    return "float32", ("float32: this CPU has no bf16 units (no AMX, no AVX-512 BF16), so bf16 matrix work would be "
                       "emulated; --dtype auto runs the model's own dtype anyway")
