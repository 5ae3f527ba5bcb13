"""What machine a benchmark ran on, printed beside its figures: speed ratios differ between CPUs,
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
