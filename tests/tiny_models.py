"""Tiny random Hugging Face checkpoints written at test time (transformers is the reference)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# architecture -> config overrides that exercise that family's differences
TINY_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "tie_word_embeddings": False,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    "mistral": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "tie_word_embeddings": False,
                "sliding_window": None},
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "tie_word_embeddings": True,
              "head_dim": 32},
}


def write_tiny_model(out_dir: Path, family: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Write config.json + model.safetensors of a random 2-layer model of ``family``."""
    import transformers

    params: dict[str, Any] = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
    )
    spec = dict(TINY_FAMILIES[family])
    model_type = spec.pop("model_type")
    params.update(spec)
    params.update(overrides)
    config = transformers.AutoConfig.for_model(model_type, **params)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    # Random init leaves norms at 1 and biases at 0; perturb them so the test sees them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def prefill_then_greedy(runners: list[Any], prompts: list[list[int]], tables: list[list[int]],
                        steps: int) -> tuple[list[int], list[list[int]]]:
    """Prefill ``prompts`` on every runner of ``runners`` (each its own pool, same blocks), then
    ``steps`` eager greedy decode steps on the first: (first tokens, [step][row] tokens after)."""
    from tandem.engine.runner import SeqInput

    firsts: list[int] = []
    for runner in runners:
        firsts = [int(x) for x in runner.forward([SeqInput(p, 0, t) for p, t in zip(prompts, tables)]).argmax(-1)]
    toks, after = list(firsts), []
    for step in range(steps):
        logits = runners[0].forward([SeqInput([t], len(p) + step, tab) for t, p, tab in zip(toks, prompts, tables)])
        toks = [int(x) for x in logits.argmax(-1)]
        after.append(toks)
    return firsts, after


def tiny_random_runner(device: str = "cpu", seed: int = 0, num_blocks: int = 96, dtype: torch.dtype = torch.float32,
                       head_dim: int = 16) -> Any:
    """A ModelRunner of ``random_weights.tiny_config`` (heads of ``head_dim``) with wide random
    weights (std 0.2: logits stand apart, so devices and kernels agree on every argmax), drawn on
    the host from ``seed`` and moved to ``device`` in ``dtype``, over a private pool of
    ``num_blocks`` blocks of 16 tokens in ``dtype``."""
    import dataclasses

    from tandem.engine.attention import make_backend
    from tandem.engine.kv_pool import KVPool, KVPoolSpec
    from tandem.engine.model import LlamaModel
    from tandem.engine.random_weights import random_weights, tiny_config
    from tandem.engine.runner import ModelRunner

    config = tiny_config()
    if head_dim != config.head_dim:
        config = dataclasses.replace(config, head_dim=head_dim, hidden_size=config.num_heads * head_dim)
    weights = {k: v.to(device=device, dtype=dtype)
               for k, v in random_weights(config, torch.float32, "cpu", seed=seed, std=0.2).items()}
    pool = KVPool.create(KVPoolSpec.for_model(config, num_blocks, 16, dtype), device)
    return ModelRunner(LlamaModel(config, weights, make_backend("torch", config.num_heads)), pool)
