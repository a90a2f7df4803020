"""Loading a checkpoint into the engine's weight dict, privately or in shared memory.

The engine's weight names are Hugging Face's with the per-layer projections fused
(``qkv_proj`` = q|k|v rows, ``gate_up_proj`` = gate|up rows) so a layer runs two matmuls fewer;
fusing happens once, before the weights are shared, so every process maps the fused copy.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from tandem.engine.config import ModelConfig
from tandem.engine.errors import ModelLoadError
from tandem.engine.shm import SharedTensorStore

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ModelLoadError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}") from None


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's files: the shards of ``model.safetensors.index.json``, else every
    ``*.safetensors`` in the directory."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"shards listed in {index} are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {model_dir}")
    return files


def load_checkpoint(model_dir: str | Path, config: ModelConfig, dtype: torch.dtype,
                    device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Read the Hugging Face checkpoint and return the engine's (fused) weights in ``dtype`` on
    ``device``; a random-weight directory (``random_weights.write_random_model``) gives its random
    weights, drawn on ``device`` (an 8B model's would take minutes on the host)."""
    from tandem.engine.random_weights import random_seed_of, random_weights

    model_dir = Path(model_dir)
    seed = random_seed_of(model_dir)
    if seed is not None:
        return random_weights(config, dtype, device, seed=seed)
    raw: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                raw[key] = f.get_tensor(key)
    return {name: tensor.to(device) for name, tensor in prepare_weights(raw, config, dtype).items()}


def _take(raw: dict[str, torch.Tensor], key: str, shape: tuple[int, ...]) -> torch.Tensor:
    try:
        tensor = raw[key]
    except KeyError:
        raise ModelLoadError(f"checkpoint is missing tensor {key!r}") from None
    if tuple(tensor.shape) != shape:
        raise ModelLoadError(f"tensor {key!r} has shape {tuple(tensor.shape)}, config expects {shape}")
    return tensor


def prepare_weights(raw: dict[str, torch.Tensor], config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Check every checkpoint tensor's shape against the config, fuse, and cast to ``dtype``."""
    c = config
    h = c.hidden_size
    out: dict[str, torch.Tensor] = {}

    def put(name: str, tensor: torch.Tensor) -> None:
        out[name] = tensor.to(dtype).contiguous()

    put("embed_tokens", _take(raw, "model.embed_tokens.weight", (c.vocab_size, h)))
    put("norm", _take(raw, "model.norm.weight", (h,)))
    if not c.tie_word_embeddings:
        put("lm_head", _take(raw, "lm_head.weight", (c.vocab_size, h)))
    proj_rows = {"q": c.q_size, "k": c.kv_size, "v": c.kv_size}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        put(f"{i}.qkv_proj", torch.cat([_take(raw, p + f"self_attn.{n}_proj.weight", (rows, h))
                                        for n, rows in proj_rows.items()]))
        if c.qkv_bias:
            put(f"{i}.qkv_bias", torch.cat([_take(raw, p + f"self_attn.{n}_proj.bias", (rows,))
                                            for n, rows in proj_rows.items()]))
        if c.qk_norm:
            put(f"{i}.q_norm", _take(raw, p + "self_attn.q_norm.weight", (c.head_dim,)))
            put(f"{i}.k_norm", _take(raw, p + "self_attn.k_norm.weight", (c.head_dim,)))
        put(f"{i}.o_proj", _take(raw, p + "self_attn.o_proj.weight", (h, c.q_size)))
        mlp = (c.intermediate_size, h)
        put(f"{i}.gate_up_proj", torch.cat([_take(raw, p + "mlp.gate_proj.weight", mlp),
                                            _take(raw, p + "mlp.up_proj.weight", mlp)]))
        put(f"{i}.down_proj", _take(raw, p + "mlp.down_proj.weight", (h, c.intermediate_size)))
        put(f"{i}.input_norm", _take(raw, p + "input_layernorm.weight", (h,)))
        put(f"{i}.post_attn_norm", _take(raw, p + "post_attention_layernorm.weight", (h,)))
    return out


def share_weights(weights: dict[str, torch.Tensor], name: str, exist_ok: bool = False) -> SharedTensorStore:
    """Copy weights into a named shared-memory store (the owner's side)."""
    return SharedTensorStore.from_tensors(name, weights, exist_ok=exist_ok)


def attach_weights(name: str) -> tuple[SharedTensorStore, dict[str, torch.Tensor]]:
    """Map weights another process shared; keep the store alive as long as the tensors are used."""
    store = SharedTensorStore.attach(name)
    return store, dict(store.tensors)
