"""ggml's block kernels through Tandem's C loop, and the ``ggml`` weight format's rules.

The kernels are built here if this machine has not built them (``./dev`` builds them before the
tests; about a minute). Stated bound: each output of a linear over exact Q4_1 / Q4_0 / Q8_0
weights, plain rows or repacked for ggml's gemm, is within 2 % of ``sum_i |x_i| |w_i|`` of fp32's ``x @ W^T`` (the scale a dot
product's rounding is measured on, since outputs may cancel to near zero); llama.cpp quantizes
the activations to 8 bits per 32-value block (Q8_1 / Q8_0), which is the whole error.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.engine import ggml_kernels, quant
from tandem.engine.ggml_kernels import GgmlType
from tandem.engine.quant import GGML_MAX_ROWS, GGML_X8_MAX_ROWS, Linear, effective_format
from tandem.engine.weight_format import WeightFormat

REL_ABS_DOT = 0.02


@pytest.fixture(scope="module", autouse=True)
def kernels() -> ggml_kernels.Kernels:
    return ggml_kernels.require()


def _exact(gtype: GgmlType, n: int, k: int, seed: int) -> torch.Tensor:
    """Random weights that ``gtype`` holds exactly (quantized, then dequantized)."""
    kern = ggml_kernels.load()
    assert kern is not None
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return kern.dequantize(kern.quantize(w, gtype), gtype, n, k)


def test_the_format_runs_once_built() -> None:
    assert effective_format(WeightFormat.GGML, torch.float32) == WeightFormat.GGML
    assert effective_format(WeightFormat.GGML, torch.bfloat16) == WeightFormat.FP32  # source must be fp32


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([GgmlType.Q4_1, GgmlType.Q4_0, GgmlType.Q8_0]), st.integers(1, 70),
       st.integers(1, 8), st.integers(0, 2**31))
def test_blocks_round_trip_exactly(gtype: GgmlType, n: int, kblocks: int, seed: int) -> None:
    kern = ggml_kernels.load()
    assert kern is not None
    k = 32 * kblocks
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    blocks = kern.quantize(w, gtype)
    assert blocks.numel() == n * kern.row_bytes(gtype, k)
    again = kern.quantize(kern.dequantize(blocks, gtype, n, k), gtype)
    assert torch.equal(again, blocks)  # what the format relies on: a GGUF's weights re-derive to its blocks


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([GgmlType.Q4_1, GgmlType.Q4_0, GgmlType.Q8_0]),
       st.one_of(st.integers(1, 90), st.integers(1, 12).map(lambda g: 8 * g)),  # whole 8-row groups often
       st.integers(1, 12), st.integers(1, 20), st.booleans(), st.integers(0, 2**31))
def test_linear_over_exact_weights(gtype: GgmlType, n: int, kblocks: int, m: int, bias: bool, seed: int) -> None:
    k = 32 * kblocks
    w = _exact(gtype, n, k, seed)
    g = torch.Generator().manual_seed(seed + 1)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(m, k, generator=g)
    lin = Linear(w, b, WeightFormat.GGML)
    assert lin.format == WeightFormat.GGML
    # Q4_1 is tried first; another type's weights are Q4_1 only by (measure-zero) chance
    assert lin.ggml_type == (gtype if gtype != GgmlType.Q4_0 else lin.ggml_type)
    assert lin.ggml_type is not None
    # Q4 layers of whole 8-row groups are repacked for ggml's gemm on an AVX2 CPU (this one)
    assert lin.ggml_repacked == (lin.ggml_type in (GgmlType.Q4_1, GgmlType.Q4_0) and n % 8 == 0)
    ref = torch.nn.functional.linear(x, w, b)
    out = lin(x)
    if m <= (GGML_X8_MAX_ROWS if lin.ggml_repacked else GGML_MAX_ROWS):
        scale = x.abs() @ w.abs().T
        assert bool(((out - ref).abs() <= REL_ABS_DOT * scale + 1e-6).all()), (out - ref).abs() / scale
    else:  # larger calls run the wide copy (fp16, or bf16 given a bf16 dot product), exactly as that format does
        assert lin.wide_format == quant.ggml_wide_format()
        assert torch.equal(out, Linear(w, b, lin.wide_format)(x))


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([GgmlType.Q4_1, GgmlType.Q4_0]), st.integers(1, 16), st.integers(1, 20), st.integers(1, 23),
       st.integers(0, 2**31))
def test_repacked_rows_compute_what_the_plain_rows_do(gtype: GgmlType, groups: int, kblocks: int, m: int,
                                                      seed: int) -> None:
    """The 8-row layout through ggml's gemm (4-row groups) and gemv (the other rows), with Q4_1's
    offsets added apart, against ggml's vec_dot over the same blocks: within the stated bound of
    the exact product, and within rounding of vec_dot (both see the same 8-bit activations, a tenth
    of the bound)."""
    kern = ggml_kernels.load()
    assert kern is not None
    n, k = 8 * groups, 32 * kblocks
    w = _exact(gtype, n, k, seed)
    blocks = kern.quantize(w, gtype)
    repacked = kern.repack_x8(blocks, gtype, n, k)
    assert repacked is not None
    x8, corr = repacked
    assert x8.numel() == n * kblocks * 18 and (corr is None) == (gtype == GgmlType.Q4_0)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1))
    out = kern.linear(x, x8, GgmlType.Q4_X8, n, corr)
    plain = kern.linear(x, blocks, gtype, n)
    scale = x.abs() @ w.abs().T
    assert bool(((out - x @ w.T).abs() <= REL_ABS_DOT * scale + 1e-6).all())
    # vec_dot keeps Q4_1's activation sums in fp16 (Q8_1's s), the repacked path in fp32: 0.12 % of the
    # scale seen at most over 40 examples
    assert bool(((out - plain).abs() <= 5e-3 * scale + 1e-6).all()), ((out - plain).abs() / scale).max()


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([GgmlType.Q4_1, GgmlType.Q4_0]), st.integers(1, 8), st.integers(1, 12), st.integers(0, 6),
       st.sampled_from([2, 3]), st.integers(0, 2**31))
def test_rows_padded_for_the_gemm_compute_what_the_gemv_does(gtype: GgmlType, groups: int, kblocks: int, fours: int,
                                                             left: int, seed: int) -> None:
    """2 or 3 rows left over after whole groups of 4 go through ggml's gemm with zero rows after
    them (faster: bench/x8_pad.py); ``TANDEM_X8_PAD=0`` sends them through the gemv one by one.
    Both see the same 8-bit activations: the outputs differ by float rounding only, far inside
    the bound the test above holds both to."""
    kern = ggml_kernels.load()
    assert kern is not None
    n, k, m = 8 * groups, 32 * kblocks, 4 * fours + left
    w = _exact(gtype, n, k, seed)
    repacked = kern.repack_x8(kern.quantize(w, gtype), gtype, n, k)
    assert repacked is not None
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1))

    def linear(rows: torch.Tensor, pad: bool) -> torch.Tensor:
        with _x8_pad(pad), _ggml_gemm():
            return kern.linear(rows, repacked[0], GgmlType.Q4_X8, n, repacked[1])

    padded, gemv = linear(x, True), linear(x, False)
    scale = x.abs() @ w.abs().T
    assert bool(((padded - gemv).abs() <= 1e-5 * scale + 1e-6).all()), ((padded - gemv).abs() / scale).max()
    assert bool(((padded - x @ w.T).abs() <= REL_ABS_DOT * scale + 1e-6).all())
    # a single row left over is not padded: the same gemv either way, bit for bit
    assert torch.equal(linear(x[: 4 * fours + 1], True), linear(x[: 4 * fours + 1], False))


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([GgmlType.Q4_1, GgmlType.Q4_0]), st.integers(1, 6), st.integers(1, 10), st.integers(1, 50),
       st.sampled_from(["", "0", "12", "14", "15"]), st.integers(0, 2**31))
def test_rows_left_over_after_groups_of_16_padded_to_16_compute_what_the_gemv_does(
        gtype: GgmlType, groups: int, kblocks: int, m: int, pad16: str, seed: int) -> None:
    """ggml's AVX2 gemm takes rows 16 at a time only over a call's leading multiple of 16; 14 or
    15 rows left over after it (``TANDEM_X8_PAD16``'s threshold, 14 by default, 0 for never) go
    through it as one more group of 16 with zero rows after them. Any row count, any threshold:
    the outputs are the unpadded path's (``TANDEM_X8_PAD=0``: groups of 4, the rest one by one)
    within float rounding, and within the bound of the exact product."""
    kern = ggml_kernels.load()
    assert kern is not None
    n, k = 8 * groups, 32 * kblocks
    w = _exact(gtype, n, k, seed)
    repacked = kern.repack_x8(kern.quantize(w, gtype), gtype, n, k)
    assert repacked is not None
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1))

    def linear(pad: bool) -> torch.Tensor:
        with _x8_pad(pad), _ggml_gemm(), _env("TANDEM_X8_PAD16", pad16):
            return kern.linear(x, repacked[0], GgmlType.Q4_X8, n, repacked[1])

    padded, unpadded = linear(True), linear(False)
    scale = x.abs() @ w.abs().T
    assert bool(((padded - unpadded).abs() <= 1e-5 * scale + 1e-6).all()), ((padded - unpadded).abs() / scale).max()
    assert bool(((padded - x @ w.T).abs() <= REL_ABS_DOT * scale + 1e-6).all())


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def _c_switch(name: str, on: bool) -> contextlib.AbstractContextManager[None]:
    """The C side's switch ``name`` (``TANDEM_X8_PAD``, ``TANDEM_X8_VNNI``: read at every call) for
    the calls inside."""
    return _env(name, "1" if on else "0")


def _x8_pad(on: bool) -> contextlib.AbstractContextManager[None]:
    return _c_switch("TANDEM_X8_PAD", on)


@contextlib.contextmanager
def _ggml_gemm() -> Iterator[None]:
    """Repacked calls through ggml's gemm and gemv, not Tandem's VNNI or AVX2 kernel."""
    with _c_switch("TANDEM_X8_VNNI", False), _c_switch("TANDEM_X8_AVX2", False):
        yield


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([GgmlType.Q4_1, GgmlType.Q4_0]), st.integers(1, 16), st.integers(1, 20), st.integers(1, 40),
       st.floats(0.01, 30), st.integers(0, 2**31))
def test_the_avx2_kernel_computes_each_row_alone_and_as_ggml_does(gtype: GgmlType, groups: int, kblocks: int,
                                                                  m: int, spread: float, seed: int) -> None:
    """On AVX2 without AVX512-VNNI every repacked call runs Tandem's kernel (``x8_avx2_tile``,
    tiles of 6 rows and the rest): each row's outputs are bit for bit that row's alone, for any
    number of rows, 8-row groups and blocks, and Q4_1's offsets, so a row's result does not depend
    on its batch; ``TANDEM_X8_AVX2=0`` (ggml's gemm and gemv) agrees within float rounding (the same
    integer block sums: its 16-bit sums cannot overflow), and both hold the bound of the exact
    product. Activations of any scale (``spread``), some rows all zeros."""
    kern = ggml_kernels.load()
    assert kern is not None
    if not kern.x8_avx2:
        pytest.skip("this CPU runs the VNNI kernel or ggml's gemm: the AVX2 kernel is not built")
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, 32 * kblocks, generator=g) * spread
    x[torch.rand(m, generator=g) < 0.1] = 0.0  # a row of zeros: scale 0
    _assert_rows_alone_and_near_ggml(kern, gtype, 8 * groups, x, seed, 1e-6 * spread)


def _assert_rows_alone_and_near_ggml(kern: ggml_kernels.Kernels, gtype: GgmlType, n: int, x: torch.Tensor, seed: int,
                                     floor: float) -> None:
    """Random exact ``gtype`` weights [n, x's width] repacked, through the kernel this CPU runs for
    ``x``'s rows: each row's outputs bit for bit that row's alone; within float rounding of ggml's
    gemm and gemv (``_ggml_gemm``) and within the bound of the exact product, both plus ``floor``."""
    m, k = x.shape
    w = _exact(gtype, n, k, seed)
    x8, corr = kern.repack_x8(kern.quantize(w, gtype), gtype, n, k) or (None, None)
    assert x8 is not None

    def linear(rows: torch.Tensor) -> torch.Tensor:
        return kern.linear(rows, x8, GgmlType.Q4_X8, n, corr)

    together = linear(x)
    assert torch.equal(together, torch.cat([linear(x[i:i + 1]) for i in range(m)]))
    with _ggml_gemm():
        ggml = linear(x)
    scale = x.abs() @ w.abs().T
    assert bool(((together - ggml).abs() <= 1e-5 * scale + floor).all()), ((together - ggml).abs() / scale).max()
    assert bool(((together - x @ w.T).abs() <= REL_ABS_DOT * scale + floor).all())


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([GgmlType.Q4_1, GgmlType.Q4_0]), st.integers(1, 16), st.integers(1, 20), st.integers(2, 40),
       st.integers(0, 2**31))
def test_the_vnni_kernel_computes_each_row_as_ggmls_gemv_does(gtype: GgmlType, groups: int, kblocks: int, m: int,
                                                               seed: int) -> None:
    """With AVX512-VNNI, calls of 2 rows or more run Tandem's kernel (``x8_vnni_tile``): each
    row's outputs are bit for bit that row's alone (a call of one row runs ggml's gemv), for any
    number of rows (tiles of 8, 4, 2 and 1), an odd number of 8-row groups and Q4_1's offsets, so a
    row's result does not depend on its batch; ``TANDEM_X8_VNNI=0`` (ggml's gemm) agrees within
    float rounding, and both hold the bound of the exact product."""
    kern = ggml_kernels.load()
    assert kern is not None
    if not kern.x8_vnni:
        pytest.skip("no AVX512-VNNI on this CPU: repacked calls run ggml's gemm alone")
    x = torch.randn(m, 32 * kblocks, generator=torch.Generator().manual_seed(seed + 1)) * 3
    _assert_rows_alone_and_near_ggml(kern, gtype, 8 * groups, x, seed, 1e-6)


# The two kernels of a Q8_0 lm_head: (type, Kernels attribute saying the CPU runs it, repack, rows a group)
Q8_HEAD_KERNELS = [(GgmlType.Q8_X16, "x8_vnni", "repack_q8_x16", 16), (GgmlType.Q8_X8, "x8_avx2", "repack_q8_x8", 8)]


@pytest.mark.parametrize(("gtype", "runs", "repack", "rows"), Q8_HEAD_KERNELS, ids=["vnni", "avx2"])
@settings(max_examples=40, deadline=None)
@given(groups=st.integers(1, 12), kblocks=st.integers(1, 20), m=st.integers(1, 40), seed=st.integers(0, 2**31))
def test_the_q8_head_kernels_compute_each_row_as_vec_dot_does(gtype: GgmlType, runs: str, repack: str, rows: int,
                                                              groups: int, kblocks: int, m: int, seed: int) -> None:
    """An lm_head's Q8_0 rows repacked 16 at a time for AVX512-VNNI (``Q8_X16``) or 8 at a time for
    AVX2 without it (``Q8_X8``) against ggml's vec_dot over the same blocks: the same integer block
    sums, so within float rounding (the sums scaled in another order), for any number of rows (every
    tile and the rows left over); each row's outputs are bit for bit that row's alone, so a row's
    logits do not depend on its batch; both hold the bound of the exact product. On a CPU the kernel
    does not run on, nothing is repacked for it."""
    kern = ggml_kernels.load()
    assert kern is not None
    n, k = rows * groups, 32 * kblocks
    w = _exact(GgmlType.Q8_0, n, k, seed)
    blocks = kern.quantize(w, GgmlType.Q8_0)
    packed = getattr(kern, repack)(blocks, n, k)
    if not getattr(kern, runs):
        assert packed is None
        pytest.skip(f"{gtype.name} does not run on this CPU ({runs} is off)")
    assert packed is not None and packed.numel() == n * k // 32 * 34  # the Q8_0 bytes, rearranged
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)) * 3
    together = kern.linear(x, packed, gtype, n)
    assert torch.equal(together, torch.cat([kern.linear(x[i:i + 1], packed, gtype, n) for i in range(m)]))
    scale = x.abs() @ w.abs().T
    vec_dot = kern.linear(x, blocks, GgmlType.Q8_0, n)
    assert bool(((together - vec_dot).abs() <= 1e-5 * scale + 1e-6).all()), ((together - vec_dot).abs() / scale).max()
    assert bool(((together - x @ w.T).abs() <= REL_ABS_DOT * scale + 1e-6).all())


def test_only_a_heads_q8_rows_in_whole_groups_repack_for_the_head_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """An lm_head's (``head=True``) Q8_0 blocks run the Q8_X16 kernel (AVX512-VNNI) for calls of up
    to ``GGML_Q8_X16_MAX_ROWS`` rows (``GGML_Q8_X16_BF16_MAX_ROWS`` where the wide copy is bf16), or
    the Q8_X8 kernel (AVX2 without VNNI) for up to ``GGML_Q8_X8_MAX_ROWS``, the wide copy beyond;
    other layers' Q8_0 blocks (the decoder layers' go whole into ``DecodeLayers``, which takes
    ggml's layouts) and rows not in whole groups (of 16, of 8) keep ggml's plain rows;
    ``TANDEM_GGML_REPACK=off`` keeps them too."""
    kern = ggml_kernels.load()
    assert kern is not None
    w = _exact(GgmlType.Q8_0, 32, 64, 4)
    head = Linear(w, None, WeightFormat.GGML, head=True)
    assert head.ggml_type == GgmlType.Q8_0 and not head.ggml_repacked
    want = GgmlType.Q8_X16 if kern.x8_vnni else GgmlType.Q8_X8 if kern.x8_avx2 else GgmlType.Q8_0
    assert head.ggml_projection is not None and head.ggml_projection.gtype == want
    assert Linear(w, None, WeightFormat.GGML).ggml_projection.gtype == GgmlType.Q8_0  # type: ignore[union-attr]
    assert Linear(w[:20], None, WeightFormat.GGML, head=True).ggml_projection.gtype == GgmlType.Q8_0  # type: ignore[union-attr]
    if kern.x8_vnni:
        assert Linear(w[:24], None, WeightFormat.GGML, head=True).ggml_projection.gtype == GgmlType.Q8_0  # type: ignore[union-attr]
        assert head.ggml_max_rows() == (quant.GGML_Q8_X16_BF16_MAX_ROWS if head.wide_format == WeightFormat.BF16
                                        else quant.GGML_Q8_X16_MAX_ROWS)
    elif kern.x8_avx2:
        assert head.ggml_max_rows() == quant.GGML_Q8_X8_MAX_ROWS
    if want != GgmlType.Q8_0:
        x = torch.randn(head.ggml_max_rows() + 1, 64, generator=torch.Generator().manual_seed(5))
        small = x[:head.ggml_max_rows()]
        assert torch.equal(head(small), kern.linear(small, head.ggml_projection.blocks, want, 32))
        assert torch.equal(head(x), Linear(w, None, head.wide_format)(x))  # more rows: the wide copy
    if kern.x8_vnni and quant.can_run_bf16():  # a bf16 wide copy (AMX's tiles): the kernel for fewer rows
        monkeypatch.setenv(quant.GGML_WIDE_ENV, "bf16")
        assert Linear(w, None, WeightFormat.GGML, head=True).ggml_max_rows() == quant.GGML_Q8_X16_BF16_MAX_ROWS
    monkeypatch.setenv("TANDEM_GGML_REPACK", "off")
    assert Linear(w, None, WeightFormat.GGML, head=True).ggml_projection.gtype == GgmlType.Q8_0  # type: ignore[union-attr]


def test_only_q4_rows_in_whole_groups_of_8_repack() -> None:
    kern = ggml_kernels.load()
    assert kern is not None
    for gtype, n in ((GgmlType.Q8_0, 16), (GgmlType.Q4_1, 12), (GgmlType.Q4_0, 4)):
        assert kern.repack_x8(kern.quantize(_exact(gtype, n, 64, 1), gtype), gtype, n, 64) is None
    w = _exact(GgmlType.Q4_1, 16, 64, 2)
    assert Linear(w, None, WeightFormat.GGML).ggml_repacked


def test_repacking_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _exact(GgmlType.Q4_1, 16, 64, 3)
    monkeypatch.setenv("TANDEM_GGML_REPACK", "off")
    lin = Linear(w, None, WeightFormat.GGML)
    assert not lin.ggml_repacked and lin.ggml_type == GgmlType.Q4_1


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 40), st.integers(1, 6), st.integers(1, 3), st.integers(0, 2**31))
def test_weights_no_block_type_holds_run_on_the_wide_copy(n: int, kblocks: int, m: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, 32 * kblocks, generator=g)
    x = torch.randn(m, 32 * kblocks, generator=g)
    lin = Linear(w, None, WeightFormat.GGML)
    assert lin.ggml_type is None
    assert lin.derived_bytes == w.numel() * 2  # the wide copy alone (fp16 or bf16)
    assert torch.equal(lin(x), Linear(w, None, lin.wide_format)(x))


def test_rows_not_a_whole_number_of_blocks_run_on_the_wide_copy() -> None:
    w = torch.randn(8, 48)
    lin = Linear(w, None, WeightFormat.GGML)
    assert lin.ggml_type is None
    x = torch.randn(1, 48)
    assert torch.equal(lin(x), Linear(w, None, lin.wide_format)(x))


def test_derived_bytes_count_both_copies() -> None:
    w = _exact(GgmlType.Q4_1, 64, 128, 3)
    lin = Linear(w, None, WeightFormat.GGML)
    kern = ggml_kernels.load()
    assert kern is not None
    assert kern.row_bytes(GgmlType.Q4_1, 128) == 4 * 20  # 32 nibbles + fp16 scale and min per block
    if lin.ggml_repacked:  # 8-row layout: 16 bytes of nibbles and an fp16 scale a block, the fp32 offsets apart
        assert lin.derived_bytes == 64 * 4 * (18 + 4) + w.numel() * 2
    else:
        assert lin.derived_bytes == 64 * kern.row_bytes(GgmlType.Q4_1, 128) + w.numel() * 2


def test_without_the_kernels_the_format_runs_as_fp16_and_says_so(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A machine where ``tandem models build-kernels`` never ran (``load()`` finds nothing)."""
    from tandem.engine import quant

    w = _exact(GgmlType.Q4_1, 8, 64, 5)
    monkeypatch.setattr(ggml_kernels, "load", lambda: None)
    quant._warn_no_ggml.cache_clear()
    with caplog.at_level("WARNING", logger="tandem.engine.quant"):
        assert effective_format(WeightFormat.GGML, torch.float32) == WeightFormat.FP16
        lin = Linear(w, None, WeightFormat.GGML)
    assert lin.format == WeightFormat.FP16 and lin.ggml_type is None
    assert "not built" in caplog.text
    quant._warn_no_ggml.cache_clear()


@pytest.mark.parametrize("choice", [None, "auto", "fp16", "bf16"])
@pytest.mark.parametrize("bf16_dot", [False, True])
@pytest.mark.parametrize("native_bf16", [False, True])
def test_the_wide_copy_is_bf16_only_where_the_cpu_has_a_bf16_dot_product(
        monkeypatch: pytest.MonkeyPatch, choice: str | None, bf16_dot: bool, native_bf16: bool) -> None:
    """The ggml format's wide copy: bf16 by default only on a CPU with a bf16 dot product (AMX tiles
    or AVX512-BF16) and native bf16 matmuls; TANDEM_GGML_WIDE forces either, bf16 only where it runs
    natively."""
    if choice is None:
        monkeypatch.delenv(quant.GGML_WIDE_ENV, raising=False)
    else:
        monkeypatch.setenv(quant.GGML_WIDE_ENV, choice)
    monkeypatch.setattr(quant, "has_bf16_dot", lambda: bf16_dot)
    monkeypatch.setattr(quant, "can_run_bf16", lambda: native_bf16)
    wants_bf16 = choice == "bf16" or (choice in (None, "auto") and bf16_dot)
    expected = WeightFormat.BF16 if wants_bf16 and native_bf16 else WeightFormat.FP16
    assert quant.ggml_wide_format() == expected


@pytest.mark.parametrize("amx", [False, True, None])
@pytest.mark.parametrize("avx512_bf16", [False, True, None])
def test_a_bf16_dot_product_is_amx_tiles_or_avx512_bf16(monkeypatch: pytest.MonkeyPatch, amx: bool | None,
                                                        avx512_bf16: bool | None) -> None:
    """``has_bf16_dot`` asks torch's CPU probes; a probe this torch lacks (None here) counts as no."""
    for name, value in (("_is_amx_tile_supported", amx), ("_is_avx512_bf16_supported", avx512_bf16)):
        if value is None:
            monkeypatch.delattr(torch.cpu, name, raising=False)
        else:
            monkeypatch.setattr(torch.cpu, name, lambda value=value: value, raising=False)
    assert quant.has_bf16_dot() == bool(amx or avx512_bf16)


def test_a_bad_wide_choice_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(quant.GGML_WIDE_ENV, "int8")
    with pytest.raises(ValueError, match="TANDEM_GGML_WIDE='int8': choose one of auto, fp16, bf16"):
        quant.ggml_wide_format()


@pytest.mark.skipif(not quant.can_run_bf16(), reason="oneDNN has no native bf16 matmuls on this CPU")
@settings(max_examples=10, deadline=None)
@given(st.integers(1, 12), st.integers(1, 6), st.integers(GGML_X8_MAX_ROWS + 1, 80), st.integers(0, 2**31))
def test_a_bf16_wide_copy_runs_the_large_calls(groups: int, kblocks: int, m: int, seed: int) -> None:
    """Forced to bf16 (what a CPU with a bf16 dot product picks), calls of more rows than ggml's
    kernels take are the bf16 format's, bit for bit; the private bytes are the blocks plus 2 a
    weight either way."""
    n, k = 8 * groups, 32 * kblocks
    w = _exact(GgmlType.Q4_1, n, k, seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(quant.GGML_WIDE_ENV, "fp16")
        fp16 = Linear(w, None, WeightFormat.GGML)
        mp.setenv(quant.GGML_WIDE_ENV, "bf16")
        bf16 = Linear(w, None, WeightFormat.GGML)
    assert (fp16.wide_format, bf16.wide_format) == (WeightFormat.FP16, WeightFormat.BF16)
    assert fp16.derived_bytes == bf16.derived_bytes
    assert torch.equal(bf16(x), Linear(w, None, WeightFormat.BF16)(x))
    assert torch.equal(fp16(x), Linear(w, None, WeightFormat.FP16)(x))
    small = x[:GGML_X8_MAX_ROWS if bf16.ggml_repacked else GGML_MAX_ROWS]  # ggml's rows: either copy
    assert torch.equal(bf16(small), fp16(small))
