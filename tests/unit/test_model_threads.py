"""A model's private weight copies built on several threads (``LlamaModel`` builds the head and
each layer on torch's intra-op threads) equal the same copies built one after another: for every
format this CPU runs, on random tiny models (Q4_1 / Q8_0-exact projections, so the ggml format
takes its blocks), the logits of a prompt and a decode batch agree bit for bit and each layer
keeps its place; an int8 build on threads leaves the process's warning filters as they were."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.engine import ggml_kernels
from tandem.engine.attention import make_backend
from tandem.engine.config import ModelConfig
from tandem.engine.ggml_kernels import GgmlType
from tandem.engine.kv_pool import KVPool, KVPoolSpec
from tandem.engine.model import LlamaModel
from tandem.engine.quant import effective_format
from tandem.engine.random_weights import random_weights
from tandem.engine.runner import ModelRunner, SeqInput
from tandem.engine.weight_format import WeightFormat


RUNNABLE = [fmt for fmt in WeightFormat if effective_format(fmt, torch.float32) == fmt]


def _weights(seed: int, layers: int) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    config = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=layers,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=512, tie_word_embeddings=False)
    weights = random_weights(config, seed=seed, std=0.15)
    kernels = ggml_kernels.load()
    if kernels is not None:  # projections the ggml format holds exactly, both block kinds
        for i, name in enumerate(n for n in weights if n.endswith("_proj") or n == "lm_head"):
            gtype, w = (GgmlType.Q4_1, GgmlType.Q8_0)[i % 2], weights[name]
            weights[name] = kernels.dequantize(kernels.quantize(w, gtype), gtype, *w.shape)
    return config, weights


def _logits(model: LlamaModel, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Each prompt's last logits, then one decode step of them all."""
    pool = KVPool.create(KVPoolSpec.for_model(model.config, 8 * len(prompts), 16))
    runner = ModelRunner(model, pool)
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(prompts))]
    out = [runner.forward([SeqInput(p, 0, t)]) for p, t in zip(prompts, tables, strict=True)]
    out.append(runner.forward([SeqInput([7], len(p), t) for p, t in zip(prompts, tables, strict=True)]))
    return out


def _built_on(threads: int, config: ModelConfig, weights: dict[str, torch.Tensor], fmt: WeightFormat) -> LlamaModel:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return LlamaModel(config, weights, make_backend("torch", config.num_heads), fmt)
    finally:
        torch.set_num_threads(before)


@settings(max_examples=16, deadline=None)
@given(seed=st.integers(0, 10_000), layers=st.integers(1, 5), threads=st.integers(2, 4),
       fmt=st.sampled_from(RUNNABLE))
def test_copies_built_on_threads_equal_those_built_in_turn(seed: int, layers: int, threads: int,
                                                           fmt: WeightFormat) -> None:
    config, weights = _weights(seed, layers)
    rng = random.Random(seed)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(rng.randrange(1, 40))] for _ in range(3)]
    one, many = _built_on(1, config, weights, fmt), _built_on(threads, config, weights, fmt)
    assert many.derived_weight_bytes == one.derived_weight_bytes
    if fmt == WeightFormat.GGML and ggml_kernels.load() is not None:
        assert [w.qkv_proj.ggml_type for w in many._layers] == [w.qkv_proj.ggml_type for w in one._layers]
    for got, want in zip(_logits(many, prompts), _logits(one, prompts), strict=True):
        assert torch.equal(got, want)


def test_an_int8_build_on_threads_leaves_the_warning_filters_as_they_were() -> None:
    if effective_format(WeightFormat.INT8, torch.float32) != WeightFormat.INT8:
        pytest.skip("int8 does not run on this CPU")
    config, weights = _weights(3, 8)
    before = list(warnings.filters)
    for _ in range(3):
        _built_on(4, config, weights, WeightFormat.INT8)
    assert warnings.filters == before
