"""What machine a benchmark ran on, printed beside its figures (ratios differ between CPUs)."""
from __future__ import annotations

import platform


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"
