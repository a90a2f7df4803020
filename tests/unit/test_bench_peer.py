"""bench/peer.py's build flags and machine record, from /proc/cpuinfo texts written here."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

FLAGS = "fpu vme sse2 ssse3 fma cx16 sse4_1 sse4_2 avx f16c avx2 bmi2"


def _peer() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "bench" / "peer.py"
    spec = importlib.util.spec_from_file_location("bench_peer", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _cpuinfo(tmp_path: Path, flags: str) -> Path:
    path = tmp_path / "cpuinfo"
    cores = [f"processor\t: {i}\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: {flags}\n" for i in range(2)]
    path.write_text("\n".join(cores))
    return path


@pytest.mark.parametrize("extra, amx", [("", False), (" avx512f avx512_vnni", False),
                                        (" avx512f amx_bf16 amx_tile amx_int8", True)])
def test_amx_is_kept_out_only_where_the_cpu_has_it(tmp_path: Path, extra: str, amx: bool) -> None:
    peer = _peer()
    cpuinfo = _cpuinfo(tmp_path, FLAGS + extra)
    flags = peer.no_amx_flags(cpuinfo)
    assert bool(flags) is amx
    assert all(f.startswith(("-DCMAKE_C_FLAGS=", "-DCMAKE_CXX_FLAGS=")) and "-mno-amx-tile" in f for f in flags)
    record = peer.cpu_model(cpuinfo)
    assert record["cpu_model"] == "Intel(R) Xeon(R) Processor"
    assert ("amx_tile" in record["cpu_flags"]) is amx and "avx2" in record["cpu_flags"]
    assert peer.no_amx_flags(tmp_path / "missing") == [] and peer.cpu_model(tmp_path / "missing") == {}


def test_the_flags_keep_amx_out_of_a_native_build(tmp_path: Path) -> None:
    """gcc keeps an explicit -mno-amx-* over what -march=native turns on, whatever the order."""
    source = tmp_path / "probe.c"
    source.write_text("#ifdef __AMX_TILE__\n#error AMX\n#endif\nint x;\n")
    flags = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16".split()
    for args in ([*flags, "-march=native"], ["-march=native", *flags]):
        done = subprocess.run(["cc", *args, "-c", str(source), "-o", str(tmp_path / "probe.o")],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
