"""This host's CPU as ``/proc/cpuinfo`` describes it: one reader for every place that keys or
records by it (the ggml kernels' build directory, admission's calibration cache, benchmarks'
JSON). Off Linux, or where the file cannot be read, each answer falls back to what ``platform``
knows (or nothing). Also the digest of Tandem's CPU kernels' source, the other half of those
keys (without torch, which the launcher does not import)."""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path
from typing import Any

CPUINFO = Path("/proc/cpuinfo")
# the vector extensions the CPU kernels here and llama.cpp's may use
VECTOR_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile")


# Tandem's C kernels, which tandem.engine.ggml_kernels builds on this host
CPU_KERNELS_SOURCE = Path(__file__).parent / "engine" / "csrc" / "cpu_kernels.c"


def cpu_kernels_digest(length: int) -> str:
    """The first ``length`` hex digits of the C kernels' source's SHA-256: a library built from
    other kernels, or an admission calibration measured on them, is not this source's."""
    return hashlib.sha256(CPU_KERNELS_SOURCE.read_bytes()).hexdigest()[:length]


def cpuinfo_field(key: str, cpuinfo: Path = CPUINFO) -> str | None:
    """The value of the first ``key : value`` line (the first core's), None if none or unreadable."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() == key:
            return value.strip()
    return None


def cpu_name(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's model name (else platform's guess)."""
    return cpuinfo_field("model name", cpuinfo) or platform.processor() or platform.machine()


def cpu_flags(cpuinfo: Path = CPUINFO) -> set[str]:
    return set((cpuinfo_field("flags", cpuinfo) or "").split())


def machine_facts(cpuinfo: Path = CPUINFO) -> dict[str, Any]:
    """What a benchmark's JSON records of the host it ran on."""
    flags = cpu_flags(cpuinfo)
    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "cpu_model": cpu_name(cpuinfo),
            "cpu_flags": [f for f in VECTOR_FLAGS if f in flags]}
