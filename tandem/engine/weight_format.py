"""The names of the linear layers' weight formats, torch-free so that command-line help and
configs can name them; ``tandem.engine.quant`` holds what each format runs."""

from __future__ import annotations

from enum import Enum


class WeightFormat(str, Enum):
    """How a process runs the linear layers (a closed set; ``auto`` picks one per CPU)."""

    FP32 = "fp32"  # the shared weights as they are: F.linear, no private copy
    FP32_PACKED = "fp32-packed"  # oneDNN's blocked fp32 layout: same numerics, faster at small batch
    BF16 = "bf16"  # oneDNN-packed bf16 weights, activations rounded to bf16, fp32 out (AVX512-BF16/AMX)
    FP16 = "fp16"  # fbgemm fp16 weights, fp32 activations and accumulation (any AVX2 + F16C CPU)
    INT8 = "int8"  # fbgemm int8, per-output-channel weight scales, dynamic per-token activations, SmoothQuant
    # llama.cpp's block-quantized weights (Q4_1, Q8_0) through ggml's kernels where they hold a
    # layer's weights exactly (a GGUF-imported model), for single-row steps; fp16 otherwise
    GGML = "ggml"

    @classmethod
    def parse(cls, name: str) -> WeightFormat:
        """A format from its name; ``auto`` is the fastest accurate format this CPU runs."""
        if name == "auto":
            from tandem.engine.quant import best_format  # needs torch; the names do not

            return best_format()
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"unknown weight format {name!r}; choose one of {FORMAT_NAMES}") from None


# Every name ``WeightFormat.parse`` takes, for flags' help and errors.
FORMAT_NAMES = ", ".join(["auto", *(f.value for f in WeightFormat)])


def default_kv_dtype(quantization: str, dtype: str, device: str = "cpu") -> str:
    """The KV pool's dtype where none is asked for: fp16 for ggml's formats on CPU (llama.cpp's own
    default cache, which the C attention reads: half the bytes a step reads, twice the tokens per
    GiB; 16-row decode steps 1.17x / 1.42x faster at context 128 / 512, perplexity +0.20 % against
    fp32's where an fp32 pool gives +0.39 %, docs/engine.md), else the weights' ``dtype``. ``quantization`` is
    the format's name as asked (``auto`` keeps ``dtype``: its formats are the batch-invariant
    ones, whose outputs track fp32's)."""
    if quantization == WeightFormat.GGML.value and dtype == "float32" and device == "cpu":
        return "float16"
    return dtype
