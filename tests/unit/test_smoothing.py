"""The int8 format's per-token activation scales and SmoothQuant factors (tandem.engine.smoothing).

Randomized over weights, activations and outliers: the smoothing is an exact identity in fp32
(powers of two), one outlier row no longer flattens the rest of its batch, and outlier channels
cost less once smoothed.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.engine.quant import Linear, WeightFormat, can_run_int8
from tandem.engine.smoothing import byte_windows, calibration_windows, row_divisor, smoothing_factors

needs_int8 = pytest.mark.skipif(not can_run_int8(), reason="this torch build has no fbgemm int8 linear")


def _data(seed: int, rows: int, in_f: int = 96, out_f: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, in_f, generator=g), torch.randn(out_f, in_f, generator=g) * 0.05


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-row error relative to the row's largest reference magnitude."""
    return (out - ref).abs().amax(-1) / ref.abs().amax(-1)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), alpha=st.floats(0.3, 0.9))
def test_factors_are_powers_of_two_and_an_exact_identity_in_fp32(seed: int, alpha: float) -> None:
    x, w = _data(seed, 5)
    absmax = x.abs().amax(0) * torch.rand(x.shape[1], generator=torch.Generator().manual_seed(seed)) * 50
    absmax[3] = 0.0  # a channel never seen active keeps 1
    s = smoothing_factors(absmax, w, alpha)
    assert s[3] == 1.0
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    # Scaling by powers of two changes no product's bits: the same sums, bit for bit.
    assert torch.equal(F.linear(x / s, w * s), F.linear(x, w))


def test_row_divisor_marks_only_the_given_rows() -> None:
    d = row_divisor(6, slice(3, 6), torch.tensor([2.0, 4.0, 8.0]))
    assert d.tolist() == [1.0, 1.0, 1.0, 2.0, 4.0, 8.0]


@needs_int8
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(2, 12), outlier=st.floats(50.0, 5000.0))
def test_an_outlier_row_leaves_the_other_rows_of_its_batch_accurate(seed: int, rows: int, outlier: float) -> None:
    """fbgemm takes one activation scale per call; a token 50-5000x larger than the others used
    to set it for every row (their error ~ the whole output). Per-row scales keep each row as
    accurate as it is alone."""
    x, w = _data(seed, rows)
    x[rows // 2] *= outlier
    lin = Linear(w, None, WeightFormat.INT8)
    ref = F.linear(x, w)
    err = _rel_err(lin(x), ref)
    alone = torch.stack([_rel_err(lin(x[i : i + 1]), ref[i : i + 1])[0] for i in range(rows)])
    assert float(err.max()) <= 0.05, err
    assert float(err.max()) <= 2 * float(alone.max()) + 0.01, (err, alone)


@needs_int8
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_smoothing_cuts_the_error_of_outlier_channels(seed: int) -> None:
    """Sixteen cases a seed: the same 1-4 channels 20-200x larger in every token (as after an
    RMSNorm). Smoothing is a heuristic, not a bound per case: it must win in most, halve the
    error on average and keep every case accurate. Measured over 3024 cases: smoothed error
    median 0.014, max 0.069 (unsmoothed: 0.037, max 0.065); over 400 seeds the 16-case mean at
    most 0.021 and at least 14 wins. A 0.05 bound per case failed one case in CI (0.064)."""
    rnd = random.Random(seed)
    wins = 0
    errors = []
    for case in range(16):
        x, w = _data(seed + case, 8)
        x[:, rnd.sample(range(x.shape[1]), rnd.randint(1, 4))] *= rnd.uniform(20.0, 200.0)
        ref = F.linear(x, w)
        plain = _rel_err(Linear(w, None, WeightFormat.INT8)(x), ref).mean()
        s = smoothing_factors(x.abs().amax(0), w)
        smoothed = _rel_err(Linear(w, None, WeightFormat.INT8, s)(x / s), ref).mean()
        wins += bool(smoothed < plain)
        errors.append(float(smoothed))
        assert float(smoothed) <= 0.1, (case, float(smoothed), float(plain))
    assert sum(errors) / len(errors) <= 0.03, errors
    assert wins >= 12, wins


@needs_int8
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_out_divisor_and_bias_fold_into_the_derived_weight(seed: int) -> None:
    x, w = _data(seed, 4)
    bias = torch.randn(w.shape[0], generator=torch.Generator().manual_seed(seed))
    div = torch.exp2(torch.randint(-3, 4, (w.shape[0],), generator=torch.Generator().manual_seed(seed + 1)).float())
    out = Linear(w, bias, WeightFormat.INT8, out_divisor=div)(x)
    ref = F.linear(x, w, bias) / div
    assert float(_rel_err(out, ref).max()) <= 0.05


def test_calibration_windows_are_fixed_and_full_length() -> None:
    windows = byte_windows(vocab_size=300)
    assert windows == byte_windows(vocab_size=300)  # the same text every time, in every process
    assert len(windows) == 4 and all(len(w) == 256 for w in windows)
    assert all(0 <= t < 300 for w in windows for t in w)
    short = calibration_windows(lambda text: list(range(10)))
    assert short == [list(range(10))]  # a text shorter than a window still calibrates
