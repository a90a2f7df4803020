"""A prompt computed in one step attends to its K/V as the pool stores them: with an fp16 or bf16
pool, the same prompt in one step or in chunks (whose later chunks read the earlier K/V back from
the pool, as decode rows and the C kernels do) gives the same logits up to fp32's last bits, not up
to the pool's rounding; greedy outputs then do not depend on how a prompt was chunked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.engine.attention import _as_stored
from tandem.engine.config import ModelConfig
from tandem.engine.kv_pool import KVPool, KVPoolSpec
from tandem.engine.quant import WeightFormat
from tandem.engine.runner import ModelRunner, position_logits
from tests.tiny_models import write_tiny_model

KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# fp32's own difference between the two (another SDPA call, other sums) is ~2.5e-7 here; the
# pool's rounding, where a whole prompt attended to unrounded K/V, moved them by 1e-4 (fp16) and
# 5e-4 (bf16).
TOLERANCE = 2e-5


@pytest.fixture(scope="module")
def runners(tmp_path_factory: pytest.TempPathFactory) -> dict[torch.dtype, ModelRunner]:
    model_dir: Path = write_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama")
    config = ModelConfig.from_dir(model_dir)
    return {kv: ModelRunner.from_dir(model_dir, KVPool.create(KVPoolSpec.for_model(config, 64, 4, kv)),
                                     weight_format=WeightFormat.FP32) for kv in KV_DTYPES}


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(KV_DTYPES), st.lists(st.integers(0, 255), min_size=2, max_size=120), st.integers(1, 40))
def test_a_prompt_in_one_step_or_in_chunks_reads_the_same_kv(runners: dict[torch.dtype, ModelRunner],
                                                           kv: torch.dtype, ids: list[int], chunk: int) -> None:
    runner = runners[kv]
    whole = position_logits(runner, ids)
    chunked = position_logits(runner, ids, chunk=chunk)
    assert float((whole - chunked).abs().max()) <= TOLERANCE


FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(FLOATS), st.sampled_from(FLOATS), st.integers(0, 2**31 - 1))
def test_new_kv_is_attended_to_as_the_pool_reads_it_back(runners: dict[torch.dtype, ModelRunner], compute: torch.dtype,
                                                        stored: torch.dtype, seed: int) -> None:
    """For every pair of activation and pool dtypes (fp16 and bf16 each lose bits to the other):
    ``_as_stored`` equals the pool's own write and read back, values at every scale (fp16's
    subnormals, fp16's overflow past 65504) included."""
    pool = runners[stored].pool
    spec = pool.spec
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(spec.block_size, spec.num_kv_heads, spec.head_dim, generator=g)
    x = (x * torch.exp2(torch.randint(-30, 20, x.shape, generator=g).float())).to(compute)
    slots = torch.arange(spec.block_size)
    pool.write(0, slots, x, x)  # block 0 of layer 0, as a step writes it
    want = pool.gather(0, torch.tensor([0]))[0, 0].to(compute)
    assert torch.equal(_as_stored(x, pool).nan_to_num(), want.nan_to_num())
