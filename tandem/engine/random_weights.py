"""Random weights in the engine's layout, for model shapes whose real weights cannot be had.

A GPU machine of this project takes no weights (no network, at most 64 MiB of files), so an
8B-shaped run measures real kernel times on random weights: every tensor has the shape the
checkpoint loader would give (``weights.prepare_weights``), drawn from a seeded generator on the
target device, linear layers N(0, 0.02) and norms near 1, so activations stay finite through
any depth. Outputs are meaningless; run with ``ignore_eos`` and fixed lengths.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tandem.engine.config import ModelConfig

if TYPE_CHECKING:
    from tandem.perf.model_shape import ModelShape  # perf imports the engine: no runtime arrow back

_STD = 0.02


def config_for_shape(shape: ModelShape, max_position_embeddings: int = 8192) -> ModelConfig:
    """A Llama-family config with ``shape``'s sizes (one rank: tensor parallelism ignored)."""
    return ModelConfig(
        architecture="Qwen3ForCausalLM" if shape.qk_norm else "LlamaForCausalLM",
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_layers=shape.num_layers, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=False, qk_norm=shape.qk_norm,
    )


def random_weights(config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                   seed: int = 0, std: float = _STD) -> dict[str, torch.Tensor]:
    """The engine's weight dict for ``config``, random, on ``device`` in ``dtype``. Tests that
    compare greedy tokens across devices pass a larger ``std`` (0.2 for ``tiny_config``): logits
    then stand apart, so kernels' last-bit differences cannot flip an argmax."""
    gen = torch.Generator(device=device).manual_seed(seed)
    c, h = config, config.hidden_size

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).mul_(std).to(dtype)

    def norm(n: int) -> torch.Tensor:
        return torch.randn(n, generator=gen, device=device, dtype=torch.float32).mul_(0.05).add_(1.0).to(dtype)

    w: dict[str, torch.Tensor] = {"embed_tokens": normal(c.vocab_size, h), "norm": norm(h)}
    if not c.tie_word_embeddings:
        w["lm_head"] = normal(c.vocab_size, h)
    for i in range(c.num_layers):
        w[f"{i}.qkv_proj"] = normal(c.q_size + 2 * c.kv_size, h)
        if c.qkv_bias:
            w[f"{i}.qkv_bias"] = normal(c.q_size + 2 * c.kv_size)
        if c.qk_norm:
            w[f"{i}.q_norm"], w[f"{i}.k_norm"] = norm(c.head_dim), norm(c.head_dim)
        w[f"{i}.o_proj"] = normal(h, c.q_size)
        w[f"{i}.gate_up_proj"] = normal(2 * c.intermediate_size, h)
        w[f"{i}.down_proj"] = normal(h, c.intermediate_size)
        w[f"{i}.input_norm"], w[f"{i}.post_attn_norm"] = norm(h), norm(h)
    return w


def tiny_config(vocab_size: int = 512, num_layers: int = 2) -> ModelConfig:
    """A small Llama config (GQA 4:2, head_dim 16) for tests that compare devices or processes."""
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
        num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=1024, tie_word_embeddings=True,
    )


# A model directory whose weights are random carries this file instead of safetensors.
MARKER = "random_weights.json"


def random_seed_of(model_dir: str | Path) -> int | None:
    """The seed of a random-weight model directory (``write_random_model``), else None."""
    marker = Path(model_dir) / MARKER
    if not marker.exists():
        return None
    return int(json.loads(marker.read_text()).get("seed", 0))


def write_random_model(out_dir: str | Path, shape: ModelShape, *, tokenizer_dir: str | Path | None = None,
                       vocab_size: int | None = None, seed: int = 0, max_position_embeddings: int = 8192) -> Path:
    """A model directory of ``shape`` with random weights: config.json, the marker (no weight
    files: loading draws them, on the device that loads them) and, from ``tokenizer_dir``, a
    tokenizer. ``vocab_size`` overrides the shape's, so that every id the model emits is one the
    tokenizer can decode."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    c = config_for_shape(shape, max_position_embeddings)
    raw = {
        "architectures": [c.architecture], "model_type": "qwen3" if c.qk_norm else "llama",
        "vocab_size": vocab_size or c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
    }
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    (out / MARKER).write_text(json.dumps({"seed": seed, "shape": shape.name}))
    if tokenizer_dir is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (Path(tokenizer_dir) / name).exists():
                shutil.copy(Path(tokenizer_dir) / name, out / name)
    return out
