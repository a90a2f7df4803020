"""oneDNN calls padded to a few row counts (``quant.onednn_rows``): the sizes, and that padding
changes no real row.

oneDNN compiles a primitive per row count and keeps 1024; ``Linear`` pads the calls of its
oneDNN formats (bf16, fp32-packed, and the ggml format's bf16 wide copy) up to ``onednn_rows``
and cuts the padding off. What it buys is measured by ``bench/onednn_rows.py``, not here.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.engine import quant
from tandem.engine.quant import ONEDNN_EXACT_ROWS, Linear, can_pack_fp32, can_run_bf16, onednn_rows
from tandem.engine.weight_format import WeightFormat

ONEDNN_FORMATS = [
    pytest.param(WeightFormat.BF16, marks=pytest.mark.skipif(not can_run_bf16(), reason="no native bf16 matmuls")),
    pytest.param(WeightFormat.FP32_PACKED,
                 marks=pytest.mark.skipif(not can_pack_fp32(torch.float32), reason="no oneDNN in this torch")),
]


@given(st.integers(1, 1 << 16))
def test_padded_rows_cover_the_call_and_waste_at_most_an_eighth(num_rows: int) -> None:
    rows = onednn_rows(num_rows)
    assert rows >= num_rows
    if num_rows <= ONEDNN_EXACT_ROWS:
        assert rows == num_rows
    else:
        assert rows - num_rows < max(8, num_rows / 8)
        assert rows % 8 == 0
    assert onednn_rows(rows) == rows  # a padded size is its own size: no call is padded twice


def test_few_sizes_and_in_order() -> None:
    sizes = [onednn_rows(n) for n in range(1, 4097)]
    assert sizes == sorted(sizes)
    # 32 exact, 4 for 33-64, 8 for each doubling after: a few hundred primitives for five shapes
    assert len(set(sizes)) == ONEDNN_EXACT_ROWS + 4 + 8 * 6
    assert [onednn_rows(n) for n in (33, 40, 41, 64, 65, 72, 73, 129, 130, 300, 513)] == [
        40, 40, 48, 64, 72, 72, 80, 144, 144, 320, 576]


@pytest.mark.parametrize("fmt", ONEDNN_FORMATS, ids=lambda f: f.value)
@settings(max_examples=20, deadline=None)
@given(num_rows=st.integers(1, 300), k=st.sampled_from([32, 64, 96]), n=st.integers(1, 80),
       bias=st.booleans(), seed=st.integers(0, 2**31))
def test_padding_changes_no_real_row(fmt: WeightFormat, num_rows: int, k: int, n: int, bias: bool,
                                     seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g) * 0.1
    layer = Linear(weight, torch.randn(n, generator=g) if bias else None, fmt)
    assert layer.wide_format == fmt
    x = torch.randn(num_rows, k, generator=g)
    calls: list[tuple[int, ...]] = []
    real = torch.ops.mkldnn._linear_pointwise

    def spy(inp: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(tuple(inp.shape))
        return real(inp, *args)

    with mock.patch.object(torch.ops.mkldnn, "_linear_pointwise", spy):
        out = layer(x)
    assert calls == [(onednn_rows(num_rows), k)]
    assert out.shape == (num_rows, n) and out.dtype == torch.float32 and out.is_contiguous()
    # the same rows padded with other values instead of zeros: no row reads another
    noisy = torch.cat([x, torch.randn(onednn_rows(num_rows) - num_rows, k, generator=g) * 100])
    with mock.patch.object(quant, "onednn_rows", lambda m: m):
        unpadded = layer(x)
        beside_noise = layer(noisy)[:num_rows]
    assert torch.equal(out, beside_noise)
    # against the call at its own row count oneDNN may pick another kernel for the tail rows:
    # the same within the format's rounding
    reference = x @ weight.T if layer.bias is None else x @ weight.T + layer.bias
    tol = 3e-2 if fmt == WeightFormat.BF16 else 1e-4
    assert torch.allclose(out, unpadded, atol=tol, rtol=tol)
    assert torch.allclose(out, reference, atol=tol * 2, rtol=tol * 2)
