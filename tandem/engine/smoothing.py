"""SmoothQuant for the int8 weight format: per-channel factors that move the activations'
outlier channels into the weights (Xiao et al., 2023, "SmoothQuant").

A linear layer ``y = x W^T`` equals ``(x / s) (W * s)^T`` for any per-input-channel ``s``. int8
activations lose the most where a few channels are much larger than the rest (after an
RMSNorm whose weights are large in those channels); ``s_j = max|x_j|^a / max|W_j|^(1-a)`` evens
the two sides out. The division by ``s`` costs nothing at run time: it is folded into the norm
weight before the layer (q/k/v, gate/up, the LM head) or into the rows of ``up`` (down's input is
``silu(gate) * up``). o_proj's input comes from attention over GQA heads and is left alone.

``max|x_j|`` is measured once per process on a fixed calibration text (docstrings of CPython's
own modules: shipped everywhere, no download, and not the text ``bench/quant.py`` and the tests
evaluate on) with the fp32 model. The factors are rounded to powers of two, so every process
derives the same int8 weights even when its thread count changes the last bits of its
measurement, and dividing by them is exact.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

# Long English docstrings of CPython's standard library, in this order.
_CALIBRATION_MODULES = ("pdb", "statistics", "argparse", "csv", "http.client", "urllib.request", "unittest",
                        "heapq", "inspect", "doctest", "subprocess")
ALPHA = 0.65  # migration strength; 0.5-0.8 measured on SmolLM2 (bench/quant.py), 0.65 the best
CALIBRATION_WINDOWS = 4
CALIBRATION_WINDOW_TOKENS = 256


def calibration_text() -> str:
    docs = (importlib.import_module(name).__doc__ or "" for name in _CALIBRATION_MODULES)
    return "\n\n".join(doc.strip() for doc in docs if doc)


def calibration_windows(encode: Callable[[str], list[int]], num: int = CALIBRATION_WINDOWS,
                        length: int = CALIBRATION_WINDOW_TOKENS) -> list[list[int]]:
    """Up to ``num`` consecutive windows of ``length`` tokens of the calibration text."""
    ids = encode(calibration_text())
    return [ids[i : i + length] for i in range(0, len(ids) - length + 1, length)][:num] or [ids[:length]]


class AbsMaxRecorder:
    """Wraps a linear layer (any callable) and keeps the largest magnitude of each input channel."""

    def __init__(self, inner: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.inner = inner
        self.absmax: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        seen = x.detach().abs().reshape(-1, x.shape[-1]).amax(dim=0).float()
        self.absmax = seen if self.absmax is None else torch.maximum(self.absmax, seen)
        return self.inner(x)


def smoothing_factors(act_absmax: torch.Tensor, weight: torch.Tensor, alpha: float = ALPHA) -> torch.Tensor:
    """Per-input-channel ``s`` [in_features], powers of two: ``x / s`` and ``W * s`` are what the
    int8 layer quantizes. Channels never seen active (or all-zero weight columns) keep 1."""
    w_max = weight.float().abs().amax(dim=0)
    act = act_absmax.float()
    live = (act > 0) & (w_max > 0)
    raw = torch.where(live, act.clamp_min(1e-30) ** alpha / w_max.clamp_min(1e-30) ** (1 - alpha),
                      torch.ones_like(act))
    return torch.exp2(torch.round(torch.log2(raw)))


def row_divisor(num_rows: int, rows: slice, divisor: torch.Tensor) -> torch.Tensor:
    """[num_rows] ones, ``divisor`` on ``rows``: what a projection's output rows are divided by
    to fold the next layer's smoothing into it."""
    out = torch.ones(num_rows)
    out[rows] = divisor
    return out


def byte_windows(vocab_size: int, num: int = CALIBRATION_WINDOWS,
                 length: int = CALIBRATION_WINDOW_TOKENS) -> list[list[int]]:
    """For a model directory without a tokenizer (the tests' tiny random checkpoints): the
    calibration text's bytes as token ids."""
    return calibration_windows(lambda text: [b % vocab_size for b in text.encode()], num, length)
