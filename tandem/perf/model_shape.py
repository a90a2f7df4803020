"""The dimensions of a Llama-family decoder that set its FLOPs and bytes."""

from __future__ import annotations

from dataclasses import dataclass, replace

from tandem.engine.config import ModelConfig

_DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
}


@dataclass(frozen=True)
class ModelShape:
    """Sizes of the whole model; the per-rank sizes under tensor parallelism are properties.

    Invariants: every size positive; `tp_degree` divides the attention heads and the MLP width.
    KV heads fewer than the TP degree are replicated, one per rank.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2
    tp_degree: int = 1
    qk_norm: bool = False

    def __post_init__(self) -> None:
        for name in (
            "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
            "intermediate_size", "vocab_size", "dtype_bytes", "tp_degree",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.num_heads % self.tp_degree or self.intermediate_size % self.tp_degree:
            raise ValueError(
                f"tp_degree {self.tp_degree} must divide num_heads {self.num_heads} "
                f"and intermediate_size {self.intermediate_size}"
            )

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.tp_degree

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.tp_degree)

    @property
    def intermediate_per_rank(self) -> int:
        return self.intermediate_size // self.tp_degree

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.vocab_size // self.tp_degree)

    def with_tp(self, tp_degree: int) -> ModelShape:
        return replace(self, tp_degree=tp_degree)

    @classmethod
    def from_config(
        cls, config: ModelConfig, *, name: str = "model", tp_degree: int = 1, dtype_bytes: int | None = None
    ) -> ModelShape:
        """Shape of a checkpoint's config.json; `dtype_bytes` overrides the stored dtype."""
        if dtype_bytes is None:
            dtype_bytes = _DTYPE_BYTES.get(config.torch_dtype.lower(), 4)
        return cls(
            name=name,
            num_layers=config.num_layers,
            hidden_size=config.hidden_size,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            dtype_bytes=dtype_bytes,
            tp_degree=tp_degree,
            qk_norm=config.qk_norm,
        )


LLAMA_3_1_8B = ModelShape(
    name="Llama-3.1-8B", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
    head_dim=128, intermediate_size=14336, vocab_size=128256,
)
QWEN3_8B = ModelShape(
    name="Qwen3-8B", num_layers=36, hidden_size=4096, num_heads=32, num_kv_heads=8,
    head_dim=128, intermediate_size=12288, vocab_size=151936, qk_norm=True,
)
# Served with TP 4 by default; `LLAMA_3_1_70B.with_tp(8)` for a full node.
LLAMA_3_1_70B = ModelShape(
    name="Llama-3.1-70B", num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8,
    head_dim=128, intermediate_size=28672, vocab_size=128256, tp_degree=4,
)

MODEL_PRESETS: dict[str, ModelShape] = {s.name: s for s in (LLAMA_3_1_8B, QWEN3_8B, LLAMA_3_1_70B)}


def model_preset(name: str) -> ModelShape:
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(sorted(MODEL_PRESETS))}") from None
