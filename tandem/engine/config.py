"""Model shape and hyper-parameters read from a Hugging Face ``config.json``.

Only Llama-family decoders are served; everything else is refused with an error that names
the architecture, so a user never gets a silently wrong model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.engine.errors import ModelLoadError

# architecture name in config.json -> model family flags
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"qkv_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
}


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency scaling; ``rope_type`` ``default`` means none."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"config field {name} must be positive, got {getattr(self, name)}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        if not archs:
            raise ModelLoadError("config.json has no 'architectures' entry; cannot tell the model family")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {arch!r}; Tandem serves "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        flags = SUPPORTED_ARCHITECTURES[arch]
        try:
            hidden = int(raw["hidden_size"])
            num_heads = int(raw["num_attention_heads"])
            num_layers = int(raw["num_hidden_layers"])
            intermediate = int(raw["intermediate_size"])
            vocab = int(raw["vocab_size"])
        except KeyError as exc:
            raise ModelLoadError(f"config.json is missing required field {exc.args[0]!r}") from None
        head_dim = raw.get("head_dim") or hidden // num_heads
        rope = _parse_rope_scaling(raw.get("rope_scaling") or raw.get("rope_parameters"))
        rope_theta = raw.get("rope_theta")
        if rope_theta is None and isinstance(raw.get("rope_parameters"), dict):
            rope_theta = raw["rope_parameters"].get("rope_theta")
        eos = raw.get("eos_token_id")
        eos_ids: tuple[int, ...] = ()
        if isinstance(eos, int):
            eos_ids = (eos,)
        elif isinstance(eos, list):
            eos_ids = tuple(int(e) for e in eos)
        qkv_bias = bool(raw.get("attention_bias", flags.get("qkv_bias", False)))
        if arch == "Qwen2ForCausalLM":
            qkv_bias = True
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=flags.get("qk_norm", False),
            rope_scaling=rope,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"model directory {model_dir} has no config.json")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None
        return cls.from_dict(raw)


def _parse_rope_scaling(raw: dict[str, Any] | None) -> RopeScaling:
    if not raw:
        return RopeScaling()
    rope_type = raw.get("rope_type") or raw.get("type") or "default"
    if rope_type == "default":
        return RopeScaling()
    if rope_type != "llama3":
        raise ModelLoadError(f"unsupported rope_scaling type {rope_type!r}; supported: default, llama3")
    return RopeScaling(
        rope_type="llama3",
        factor=float(raw["factor"]),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
    )
