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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32 and scale in the weight dtype, as Hugging Face does.
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * normed.to(x.dtype)


class LlamaModel:
    """Weights + config; ``embed`` / ``layer`` / ``logits`` are the three stages of a forward."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], attention: AttentionBackend):
        self.config = config
        self.weights = weights
        self.attention = attention
        self.dtype = weights["embed_tokens"].dtype
        self.rotary = RotaryCache(config, self.dtype)
        self.lm_head = weights["embed_tokens"] if config.tie_word_embeddings else weights["lm_head"]
        # Per-layer weight tuples, looked up once rather than by string on every call.
        self._layers = [self._layer_weights(i) for i in range(config.num_layers)]

    def _layer_weights(self, i: int) -> dict[str, torch.Tensor | None]:
        w = self.weights
        return {
            "input_norm": w[f"{i}.input_norm"],
            "qkv_proj": w[f"{i}.qkv_proj"],
            "qkv_bias": w.get(f"{i}.qkv_bias"),
            "q_norm": w.get(f"{i}.q_norm"),
            "k_norm": w.get(f"{i}.k_norm"),
            "o_proj": w[f"{i}.o_proj"],
            "post_attn_norm": w[f"{i}.post_attn_norm"],
            "gate_up_proj": w[f"{i}.gate_up_proj"],
            "down_proj": w[f"{i}.down_proj"],
        }

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
        x = rms_norm(hidden, w["input_norm"], c.rms_norm_eps)  # type: ignore[arg-type]
        qkv = F.linear(x, w["qkv_proj"], w["qkv_bias"])  # type: ignore[arg-type]
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.view(num_tokens, c.num_heads, c.head_dim)
        k = k.view(num_tokens, c.num_kv_heads, c.head_dim)
        v = v.view(num_tokens, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = rms_norm(q, w["q_norm"], c.rms_norm_eps)  # type: ignore[arg-type]
            k = rms_norm(k, w["k_norm"], c.rms_norm_eps)  # type: ignore[arg-type]
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        attn = self.attention.forward(index, q, k, v, attn_meta, pool)  # [num_tokens, H, d]
        hidden = hidden + F.linear(attn.reshape(num_tokens, c.q_size), w["o_proj"])  # type: ignore[arg-type]
        x = rms_norm(hidden, w["post_attn_norm"], c.rms_norm_eps)  # type: ignore[arg-type]
        gate, up = F.linear(x, w["gate_up_proj"]).chunk(2, dim=-1)  # type: ignore[arg-type]
        return hidden + F.linear(F.silu(gate) * up, w["down_proj"])  # type: ignore[arg-type]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head for the given rows: [n, hidden] -> [n, vocab] in fp32."""
        x = rms_norm(hidden, self.weights["norm"], self.config.rms_norm_eps)
        return F.linear(x, self.lm_head).float()
