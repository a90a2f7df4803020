"""Cost of one prediction, for the benchmark (goal: <= 20 us for a decode batch of 32)."""

from __future__ import annotations

import time

from tandem.perf.hardware import A100_80G, HardwareSpec
from tandem.perf.model import PerfModel
from tandem.perf.model_shape import LLAMA_3_1_8B, ModelShape


def time_prediction(
    n: int = 10_000,
    *,
    hardware: HardwareSpec = A100_80G,
    shape: ModelShape = LLAMA_3_1_8B,
    batch_size: int = 32,
) -> float:
    """Mean microseconds per `predict_decode` call on a batch of `batch_size` varied contexts.

    Contexts change every call, as they do between decode steps, so the attention term is really
    recomputed; the token-level memo is warm, as it is in a running service.
    """
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    model = PerfModel(hardware, shape)
    units = hardware.num_units
    batches = [[512 + 37 * i + j for i in range(batch_size)] for j in range(16)]
    model.predict_decode(batches[0], units)
    start = time.perf_counter()
    for k in range(n):
        model.predict_decode(batches[k & 15], units)
    return (time.perf_counter() - start) / n * 1e6
