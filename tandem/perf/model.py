"""Latency of a prefill batch, a decode step or a hybrid batch on `units` units.

Per-operator roofline (DuetServe §4.1) on the SM-scaling roofline (Bullet §3.2.2, Eq. 1):
- token-level operators (norms, QKV, O, gate-up, activation, down, embedding, lm-head) cost
  F = 2 n d_i d_o and B = (n d_i + d_i d_o + n d_o) b for a linear, from the number of tokens;
- attention is per request, from its query length q and cached length c:
  F = (4 d_h + 2) h_q P, B = 2 h_q q d_h b + 2 h_kv (q + c) d_h b, t = sum_r max(F_r / C, B_r / D),
  where P = q c + q (q + 1) / 2 is the causal count of query-key pairs (DuetServe writes
  P = q (q + c), which is right for a chunk after a long prefix but doubles a whole prompt's);
  prefill attention runs at `attn_efficiency` of the GEMMs' rate (Bullet §2.2.2);
- tensor parallelism adds two ring all-reduces of the hidden state per layer;
- compute C = per-unit FLOP/s x units; bandwidth D = peak x min(1, units / knee);
- on a GPU GEMMs and prefill attention run in waves of thread blocks on `units` SMs and pay
  Bullet's wave quantization (see `gemm_compute_time` and `_attention`);
- every kernel pays the hardware's fixed `op_overhead_s`.
The sum is the uncalibrated latency T'; the prediction is T' x alpha (calibration, Bullet Eq. 2)
x the contention guard's slowdown when the other phase runs beside it (MuxWise §3.3.2).

Token-level costs depend only on (tokens, logits rows, units) and are memoised, and decode
attention has a closed form in sum(context lengths), so a decode prediction does no per-request
work beyond one `sum`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.perf.calibration import Calibration, CalibrationSample, ContentionGuard
from tandem.perf.hardware import HardwareSpec
from tandem.perf.model_shape import ModelShape
from tandem.perf.roofline import ring_allreduce_time, wave_idle_ratio

def causal_pairs(q: int, c: int, tile: int = 1) -> int:
    """Query-key pairs a causal attention kernel computes for q new tokens after c cached ones.

    Query i (0-based) attends c + i + 1 keys. A kernel working in query tiles of `tile` rows
    (FlashAttention's Bq) computes every key a tile's last row needs for the whole tile, so
    tile t of T = ceil(q / tile) covers c + (t + 1) tile keys: tile (T c + tile T (T + 1) / 2).
    With tile 1 this is the exact q c + q (q + 1) / 2. The sum over the chunks of a prompt
    equals the prompt's own count (up to tile rounding): chunking moves no attention work,
    it re-reads the prefix's K/V once per chunk.
    """
    if tile <= 1:
        return q * c + q * (q + 1) // 2
    num_tiles = -(-q // tile)
    return tile * (num_tiles * c + tile * num_tiles * (num_tiles + 1) // 2)


TOKEN_OPS = ("embed", "norms", "qkv", "o_proj", "gate_up", "act", "down", "allreduce", "lm_head")
_CACHE_LIMIT = 8192


@dataclass(frozen=True)
class LatencyBreakdown:
    """Seconds per operator for the whole model (all layers), before calibration and contention;
    `total_s` is what the predict_* methods return."""

    op_s: dict[str, float]
    roofline_s: float
    calibration_factor: float
    contention_factor: float
    total_s: float


class PerfModel:
    """Pure latency predictor for one model shape on one device. No I/O, no clock reads.

    `calibration` and `contention` may be shared with an online updater; `observe` feeds a live
    timing back into the calibration.
    """

    def __init__(
        self,
        hardware: HardwareSpec,
        shape: ModelShape,
        calibration: Calibration | None = None,
        contention: ContentionGuard | None = None,
    ) -> None:
        self.hardware = hardware
        self.shape = shape
        self.calibration = calibration if calibration is not None else Calibration()
        self.contention = contention
        s = shape
        b = s.dtype_bytes
        self._b = b
        self._d = s.hidden_size
        self._hq = s.heads_per_rank
        self._hkv = s.kv_heads_per_rank
        self._dh = s.head_dim
        self._layers = s.num_layers
        self._qkv_out = (self._hq + 2 * self._hkv) * self._dh
        self._q_width = self._hq * self._dh
        self._m = s.intermediate_per_rank
        self._vocab = s.vocab_per_rank
        # Attention per-request coefficients (DuetServe §4.1), all layers folded in:
        #   F_r = attn_f * causal_pairs(q, c),  B_r = attn_bq * q + attn_bkv * (q + c).
        self._attn_f = (4 * self._dh + 2) * self._hq * self._layers
        self._attn_bq = 2 * self._hq * self._dh * b * self._layers
        self._attn_bkv = 2 * self._hkv * self._dh * b * self._layers
        # FLOP/s of one thread block running tile (tm, tn): its SM's share, derated when the
        # tile's operand intensity is below the knee.
        self._tile_rates: list[tuple[tuple[int, int], float]] = []
        for tm, tn in hardware.gemm_tiles:
            intensity = 2.0 * tm * tn / ((tm + tn) * b)
            derate = min(1.0, intensity / hardware.tile_intensity_knee)
            block_rate = hardware.peak_flops_per_unit / hardware.blocks_per_sm * derate
            self._tile_rates.append(((tm, tn), block_rate))
        self._token_cache: dict[tuple[int, int, int], tuple[float, ...]] = {}

    # ---- primitives ------------------------------------------------------------------------

    def _check_units(self, units: int) -> None:
        if not 0 < units <= self.hardware.num_units:
            raise ValueError(f"units must be in [1, {self.hardware.num_units}], got {units}")

    def gemm_compute_time(self, num_tokens: int, in_features: int, out_features: int, units: int) -> float:
        """Compute-bound time of a GEMM on `units` units.

        On a GPU a GEMM runs in waves of thread blocks (Bullet §2.2.1): each block computes a
        tm x tn output tile over the whole reduction, a wave is `blocks_per_sm` blocks on each of
        `units` SMs, and the kernel lasts w = ceil(blocks / (b N)) waves. Padded rows cost like
        real ones, which keeps the time non-decreasing in tokens and non-increasing in units. A
        tile keeps the tensor cores busy only when its operand intensity 2 tm tn / ((tm + tn) b)
        reaches the hardware's `tile_intensity_knee`; the library is taken to pick the fastest
        candidate tile.
        """
        hw = self.hardware
        if hw.num_sms is None:
            return 2.0 * num_tokens * in_features * out_features / hw.compute_rate(units)
        per_wave = hw.blocks_per_sm * units
        best = math.inf
        for (tm, tn), tile_rate in self._tile_rates:
            blocks = -(-num_tokens // tm) * -(-out_features // tn)
            waves = -(-blocks // per_wave)
            best = min(best, waves * 2.0 * tm * tn * in_features / tile_rate)
        return best

    def linear_time(self, num_tokens: int, in_features: int, out_features: int, units: int) -> float:
        """One linear layer of `num_tokens` rows (DuetServe's F_lin and B_lin on the SM-scaling
        roofline, compute in waves), plus the per-operator overhead."""
        hw = self.hardware
        num_bytes = float(num_tokens * in_features + in_features * out_features + num_tokens * out_features)
        compute = self.gemm_compute_time(num_tokens, in_features, out_features, units)
        return hw.op_overhead_s + max(compute, num_bytes * self._b / hw.bandwidth(units))

    def _elementwise_time(self, flops: float, num_bytes: float, units: int) -> float:
        hw = self.hardware
        return hw.op_overhead_s + max(flops / hw.compute_rate(units), num_bytes / hw.bandwidth(units))

    def _token_ops(self, n: int, n_logits: int, units: int) -> tuple[float, ...]:
        """Times of TOKEN_OPS for `n` tokens, all layers, memoised per (n, n_logits, units)."""
        key = (n, n_logits, units)
        cached = self._token_cache.get(key)
        if cached is not None:
            return cached
        hw, s, b, d, L = self.hardware, self.shape, self._b, self._d, self._layers
        embed = hw.op_overhead_s + 2.0 * n * d * b / hw.bandwidth(units)
        norm_one = self._elementwise_time(4.0 * n * d, (2.0 * n * d + d) * b, units)
        norms = 2 * norm_one
        if s.qk_norm:
            width = (self._hq + self._hkv) * self._dh
            norms += self._elementwise_time(4.0 * n * width, (2.0 * n * width + 2 * self._dh) * b, units)
        qkv = self.linear_time(n, d, self._qkv_out, units)
        o_proj = self.linear_time(n, self._q_width, d, units)
        gate_up = self.linear_time(n, d, 2 * self._m, units)
        act = self._elementwise_time(4.0 * n * self._m, 3.0 * n * self._m * b, units)
        down = self.linear_time(n, self._m, d, units)
        allreduce = 2 * ring_allreduce_time(
            float(n * d * b), s.tp_degree, hw.link_bandwidth, hw.link_latency_s, hw.compute_rate(units)
        )
        lm_head = 0.0
        if n_logits > 0:
            lm_head = self._elementwise_time(4.0 * n_logits * d, (2.0 * n_logits * d + d) * b, units)
            lm_head += self.linear_time(n_logits, d, self._vocab, units)
        result = (
            embed,
            L * norms,
            L * qkv,
            L * o_proj,
            L * gate_up,
            L * act,
            L * down,
            L * allreduce,
            lm_head,
        )
        if len(self._token_cache) >= _CACHE_LIMIT:
            self._token_cache.clear()
        self._token_cache[key] = result
        return result

    def _attention(
        self, prefill_seqs: Sequence[tuple[int, int]], decode_context_lens: Sequence[int], units: int
    ) -> float:
        """sum_r max(F_r / C, B_r / D) over prefill and decode requests, all layers (DuetServe).

        F_r counts the query-key pairs a causal kernel computes (`causal_pairs`), not
        DuetServe's q (q + c), which charges a whole prompt twice its attention. On a GPU the
        prefill kernel runs ceil(q / Bq) x h_q blocks per request in waves, so its compute term
        is stretched by Bullet's wave idle, F / (C (1 - idle)), and divided by the hardware's
        `attn_efficiency`. Decode attention is memory-bound and not quantized.
        """
        hw = self.hardware
        num_decode = len(decode_context_lens)
        if not prefill_seqs and not num_decode:
            return 0.0
        inv_c = 1.0 / hw.compute_rate(units)
        inv_d = 1.0 / hw.bandwidth(units)
        a_f, a_bq, a_bkv = self._attn_f * inv_c, self._attn_bq * inv_d, self._attn_bkv * inv_d
        total = 0.0
        if prefill_seqs:
            bq = hw.attn_block_q
            if hw.num_sms is None:
                stretch, tile = 1.0, 1
            else:
                blocks = sum(-(-q // bq) for q, _ in prefill_seqs) * self._hq
                idle = wave_idle_ratio(blocks, units, hw.blocks_per_sm)
                stretch, tile = 1.0 / (1.0 - idle), bq
            a_fp = a_f * stretch / hw.attn_efficiency
            for q, c in prefill_seqs:
                total += max(a_fp * causal_pairs(q, c, tile), a_bq * q + a_bkv * (q + c))
        if num_decode:
            # q = 1: compute a_f (1 + c) against memory a_bq + a_bkv (1 + c), both linear in c.
            if a_f <= a_bkv:  # memory-bound for every c >= 0
                total += a_bq * num_decode + a_bkv * (sum(decode_context_lens) + num_decode)
            elif a_f >= a_bq + a_bkv:  # compute-bound for every c >= 0
                total += a_f * (sum(decode_context_lens) + num_decode)
            else:
                for c in decode_context_lens:
                    total += max(a_f * (1 + c), a_bq + a_bkv * (1 + c))
        return total + hw.op_overhead_s * self._layers

    # ---- predictions -----------------------------------------------------------------------

    def _roofline(
        self, prefill_seqs: Sequence[tuple[int, int]], decode_context_lens: Sequence[int], units: int
    ) -> tuple[float, int, str]:
        self._check_units(units)
        num_prefill_tokens = sum(q for q, _ in prefill_seqs)
        num_decode = len(decode_context_lens)
        n = num_prefill_tokens + num_decode
        if n == 0:
            return 0.0, 0, "decode"
        token_s = sum(self._token_ops(n, len(prefill_seqs) + num_decode, units))
        attn_s = self._attention(prefill_seqs, decode_context_lens, units)
        phase = "hybrid" if prefill_seqs and num_decode else ("prefill" if prefill_seqs else "decode")
        return token_s + attn_s, n, phase

    def _finish(self, roofline_s: float, n: int, phase: str, units: int, other_units: int) -> float:
        if n == 0:
            return 0.0
        slowdown = 1.0
        if self.contention is not None and other_units > 0:
            slowdown = self.contention.lookup(phase, units, other_units)
        return self.calibration.predict(phase, roofline_s * slowdown, n, units)

    def predict_prefill(self, seqs: Sequence[tuple[int, int]], units: int, *, other_units: int = 0) -> float:
        """Seconds to prefill `seqs`, each (new_tokens, cached_tokens), on `units` units while the
        other phase holds `other_units` units (0: running alone)."""
        roof, n, phase = self._roofline(seqs, (), units)
        return self._finish(roof, n, phase, units, other_units)

    def predict_decode(self, context_lens: Sequence[int], units: int, *, other_units: int = 0) -> float:
        """Seconds for one decode step of requests with these context (cached) lengths."""
        roof, n, phase = self._roofline((), context_lens, units)
        return self._finish(roof, n, phase, units, other_units)

    def predict_hybrid(
        self,
        prefill_seqs: Sequence[tuple[int, int]],
        decode_context_lens: Sequence[int],
        units: int,
        *,
        other_units: int = 0,
    ) -> float:
        """Seconds for one aggregated batch of prefill chunks and decode tokens."""
        roof, n, phase = self._roofline(prefill_seqs, decode_context_lens, units)
        return self._finish(roof, n, phase, units, other_units)

    def breakdown(
        self,
        prefill_seqs: Sequence[tuple[int, int]],
        decode_context_lens: Sequence[int],
        units: int,
        *,
        other_units: int = 0,
    ) -> LatencyBreakdown:
        """Per-operator seconds of the batch predict_hybrid would time (slow path, for reports)."""
        roof, n, phase = self._roofline(prefill_seqs, decode_context_lens, units)
        op_s: dict[str, float] = {}
        if n:
            token = self._token_ops(n, len(prefill_seqs) + len(decode_context_lens), units)
            op_s = dict(zip(TOKEN_OPS, token))
            op_s["attention"] = self._attention(prefill_seqs, decode_context_lens, units)
        total = self._finish(roof, n, phase, units, other_units)
        calib = self.calibration.factor(phase, n, units) if n else 1.0
        return LatencyBreakdown(
            op_s=op_s,
            roofline_s=roof,
            calibration_factor=calib,
            contention_factor=total / (roof * calib) if roof > 0 else 1.0,
            total_s=total,
        )

    def observe(
        self,
        prefill_seqs: Sequence[tuple[int, int]],
        decode_context_lens: Sequence[int],
        units: int,
        measured_s: float,
    ) -> None:
        """Online recalibration from a live, uncontended timing of this batch."""
        roof, n, phase = self._roofline(prefill_seqs, decode_context_lens, units)
        if n and roof > 0 and measured_s > 0:
            self.calibration.update(CalibrationSample(phase, n, units, measured_s, roof))

    def sample(
        self,
        prefill_seqs: Sequence[tuple[int, int]],
        decode_context_lens: Sequence[int],
        units: int,
        measured_s: float,
    ) -> CalibrationSample:
        """A calibration sample pairing a measurement with this model's uncalibrated prediction."""
        roof, n, phase = self._roofline(prefill_seqs, decode_context_lens, units)
        return CalibrationSample(phase, n, units, measured_s, roof)
