"""A Llama-family decoder as plain functions over a weight dict (gpt-fast's shape, paged KV).

Covers Llama 2/3 (llama3 rope scaling), Mistral, Qwen2 (q/k/v bias), Qwen3 (per-head q/k
RMSNorm) and SmolLM2, with GQA and tied or separate embeddings. Numerics follow Hugging Face's
implementation (norms in fp32, rotate-half rope) so logits match it within fp32 rounding.

The model runs on a flattened batch: all new tokens of all sequences in one
``[num_tokens, hidden]`` tensor; attention is the only place that cares which token belongs
to which sequence (see ``attention.SeqSpan``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tandem.engine.attention import AttentionBackend
from tandem.engine.config import ModelConfig, RopeScaling
from tandem.engine.kv_pool import KVPool


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies [head_dim // 2], with llama3 scaling when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryCache:
    """cos/sin tables for every position up to the context length, computed once."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inv_freq(config))  # [max_pos, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_pos, d]
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]  # [num_tokens, d] each


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, heads, d]; cos/sin [num_tokens, d]."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


# Decode-sized batch the packed layout is tuned for; it stays correct (and faster than the
# plain layout in our measurements) from 1 to hundreds of rows.
_PACK_BATCH_HINT = 8


def can_pack_weights(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pre-pack fp32 linear weights on this CPU build."""
    return (
        dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class Linear:
    """``y = x @ W^T + b``, with W optionally pre-packed into oneDNN's blocked layout.

    Why: decode on a CPU is memory-bound at small batch and MKL's plain sgemm streams an
    [N, K] weight at well under the memory bandwidth when M is ~1-32; the packed layout
    (what torch.compile's CPU freezing uses) reads it about 1.5-3x faster. A packed weight is
    a private copy of this process, so it is opt-in: shared-memory weights stay unpacked.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool) -> None:
        self.weight = weight  # [out_features, in_features]
        self.bias = bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT) if pack else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            return out
        return F.linear(x, self.weight, self.bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32 and scale in the weight dtype, as Hugging Face does.
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * normed.to(x.dtype)


class LlamaModel:
    """Weights + config; ``embed`` / ``layer`` / ``logits`` are the three stages of a forward."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        attention: AttentionBackend,
        pack_weights: bool = False,
    ) -> None:
        """``pack_weights`` pre-packs linear weights for this CPU (a private copy; see ``Linear``);
        it is ignored where oneDNN cannot pack the dtype."""
        self.config = config
        self.weights = weights
        self.attention = attention
        self.dtype = weights["embed_tokens"].dtype
        self.pack_weights = pack_weights and can_pack_weights(self.dtype)
        self.rotary = RotaryCache(config, self.dtype)
        lm_head = weights["embed_tokens"] if config.tie_word_embeddings else weights["lm_head"]
        self.lm_head = Linear(lm_head, None, self.pack_weights)
        # Per-layer weights, looked up once rather than by string on every call.
        self._layers = [_LayerWeights(weights, i, self.pack_weights) for i in range(config.num_layers)]

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weights["embed_tokens"])  # [num_tokens, hidden]

    def layer(
        self,
        index: int,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_meta: object,
        pool: KVPool,
    ) -> torch.Tensor:
        c = self.config
        w = self._layers[index]
        num_tokens = hidden.shape[0]
        x = rms_norm(hidden, w.input_norm, c.rms_norm_eps)
        q, k, v = w.qkv_proj(x).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.view(num_tokens, c.num_heads, c.head_dim)
        k = k.view(num_tokens, c.num_kv_heads, c.head_dim)
        v = v.view(num_tokens, c.num_kv_heads, c.head_dim)
        if w.q_norm is not None and w.k_norm is not None:
            q = rms_norm(q, w.q_norm, c.rms_norm_eps)
            k = rms_norm(k, w.k_norm, c.rms_norm_eps)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        attn = self.attention.forward(index, q, k, v, attn_meta, pool)  # [num_tokens, H, d]
        hidden = hidden + w.o_proj(attn.reshape(num_tokens, c.q_size))
        x = rms_norm(hidden, w.post_attn_norm, c.rms_norm_eps)
        gate, up = w.gate_up_proj(x).chunk(2, dim=-1)
        return hidden + w.down_proj(F.silu(gate) * up)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head for the given rows: [n, hidden] -> [n, vocab] in fp32."""
        x = rms_norm(hidden, self.weights["norm"], self.config.rms_norm_eps)
        return self.lm_head(x).float()


class _LayerWeights:
    def __init__(self, w: dict[str, torch.Tensor], i: int, pack: bool) -> None:
        self.input_norm = w[f"{i}.input_norm"]
        self.qkv_proj = Linear(w[f"{i}.qkv_proj"], w.get(f"{i}.qkv_bias"), pack)
        self.q_norm = w.get(f"{i}.q_norm")
        self.k_norm = w.get(f"{i}.k_norm")
        self.o_proj = Linear(w[f"{i}.o_proj"], None, pack)
        self.post_attn_norm = w[f"{i}.post_attn_norm"]
        self.gate_up_proj = Linear(w[f"{i}.gate_up_proj"], None, pack)
        self.down_proj = Linear(w[f"{i}.down_proj"], None, pack)
