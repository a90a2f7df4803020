"""The closed-form pieces of the model: wave quantization, the SM-scaling roofline, all-reduce."""

from __future__ import annotations

import math


def wave_idle_ratio(num_blocks: int, num_sms: int, blocks_per_sm: int = 1) -> float:
    """Fraction of SM time a kernel of `num_blocks` thread blocks leaves idle (Bullet §2.2.1).

    w = ceil(g / (b N)) waves; the tail wave keeps tail = ceil(g/b - N (w - 1)) SMs busy
    (Most-Room policy); idle = (N - tail) / (N w). Zero blocks idle nothing.
    """
    if num_blocks <= 0:
        return 0.0
    per_wave = blocks_per_sm * num_sms
    waves = -(-num_blocks // per_wave)
    tail = math.ceil(num_blocks / blocks_per_sm - num_sms * (waves - 1))
    return (num_sms - tail) / (num_sms * waves)


def gemm_blocks(num_tokens: int, out_features: int, tile: tuple[int, int]) -> int:
    """Thread blocks of a [num_tokens, in] x [in, out_features] GEMM with output tiles `tile`."""
    tile_tokens, tile_features = tile
    return -(-num_tokens // tile_tokens) * -(-out_features // tile_features)


def roofline_time(flops: float, num_bytes: float, compute_rate: float, bandwidth: float) -> float:
    """max(F / C_p, B / D_p): Bullet Eq. 1 written as a max, DuetServe's t_tok."""
    return max(flops / compute_rate, num_bytes / bandwidth)


def ring_allreduce_time(
    num_bytes: float, num_ranks: int, link_bandwidth: float, link_latency_s: float, compute_rate: float
) -> float:
    """Ring all-reduce of `num_bytes` per rank (DuetServe §4.1):
    2(N-1) alpha + 2(N-1) B / (N W) + N(N-1) B / Pi, the last term being the local reductions as
    DuetServe writes it (its units are elements, so it is tiny next to the transfer)."""
    if num_ranks <= 1:
        return 0.0
    n = num_ranks
    transfer = 2 * (n - 1) * num_bytes / (n * link_bandwidth) if link_bandwidth > 0 else 0.0
    return 2 * (n - 1) * link_latency_s + transfer + n * (n - 1) * num_bytes / compute_rate
