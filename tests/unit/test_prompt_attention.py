"""Prompt rows in bf16 attention (``model.prompt_attention_dtype``): chosen only for an fp32
model whose projections' wide copy is bf16, turned off by TANDEM_PROMPT_ATTENTION=model; on the
torch backend it moves the rows of prompts with nothing cached, of PROMPT_LOW_MIN_TOKENS or more,
by bf16's rounding (their padding to a bucket changes nothing more), and leaves every other row
bit for bit as it was (shorter prompts, prompts after a cached prefix, decode rows), on random
batches of all of them."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.engine.attention import PROMPT_LOW_BUCKET, PROMPT_LOW_MIN_TOKENS, SeqSpan, TorchPagedAttention
from tandem.engine.kv_pool import KVPool, KVPoolSpec
from tandem.engine.model import PROMPT_ATTENTION_ENV, prompt_attention_dtype
from tandem.engine.weight_format import WeightFormat


def test_bf16_only_for_an_fp32_model_on_a_bf16_wide_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    assert prompt_attention_dtype(WeightFormat.BF16, torch.float32) == torch.bfloat16
    for wide in (WeightFormat.FP16, WeightFormat.FP32, WeightFormat.GGML, WeightFormat.INT8):
        assert prompt_attention_dtype(wide, torch.float32) is None
    assert prompt_attention_dtype(WeightFormat.BF16, torch.bfloat16) is None  # attends in its own dtype
    monkeypatch.setenv(PROMPT_ATTENTION_ENV, "model")
    assert prompt_attention_dtype(WeightFormat.BF16, torch.float32) is None
    monkeypatch.setenv(PROMPT_ATTENTION_ENV, "fp8")
    with pytest.raises(ValueError, match="choose auto or model"):
        prompt_attention_dtype(WeightFormat.BF16, torch.float32)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([1, 2, 3]), st.sampled_from([1, 3]), st.sampled_from([16, 64]), st.booleans(),
       st.integers(0, 2**31))
def test_prompt_rows_move_by_bf16_rounding_and_decode_rows_not_at_all(kv_heads: int, group: int, head_dim: int,
                                                                      c_decode: bool, seed: int) -> None:
    rng = random.Random(seed)
    block_size = 16
    num_blocks = 8 * (600 + 200) // 16 + 8
    spec = KVPoolSpec(1, num_blocks, block_size, kv_heads, head_dim, torch.float32)
    pool = KVPool.create(spec)
    gen = torch.Generator().manual_seed(seed)
    pool.tensor.copy_(torch.randn(spec.shape, generator=gen))
    free = list(range(num_blocks))
    rng.shuffle(free)
    spans, row = [], 0
    for _ in range(rng.randint(1, 8)):
        kind = rng.choice(["decode", "fresh", "cached"])
        q_len = 1 if kind == "decode" else rng.choice([rng.randint(2, PROMPT_LOW_MIN_TOKENS + 40),
                                                       rng.randint(PROMPT_LOW_MIN_TOKENS, 3 * PROMPT_LOW_BUCKET + 300)])
        cached = 0 if kind == "fresh" else rng.randint(1, 200)
        blocks = [free.pop() for _ in range(-(-(cached + q_len) // block_size))]
        spans.append(SeqSpan(row, q_len, cached, blocks))
        row += q_len
    q = torch.randn(row, kv_heads * group, head_dim, generator=gen)
    k, v = (torch.randn(row, kv_heads, head_dim, generator=gen) for _ in range(2))
    outs = []
    for low in (None, torch.bfloat16):
        backend = TorchPagedAttention(c_decode=c_decode)
        backend.prompt_dtype = low
        own = KVPool(spec, pool.tensor.clone())
        outs.append(backend.forward(0, q, k, v, backend.plan(spans, own), own))
        assert outs[-1].dtype == torch.float32
    for span in spans:
        rows = slice(span.q_start, span.q_start + span.q_len)
        if span.num_cached or span.q_len < PROMPT_LOW_MIN_TOKENS:
            assert torch.equal(outs[0][rows], outs[1][rows])
        else:  # an average of values of magnitude ~1, rounded to bf16 (8 bits of mantissa) on the way
            torch.testing.assert_close(outs[1][rows], outs[0][rows], atol=3e-2, rtol=3e-2)
            assert not torch.equal(outs[1][rows], outs[0][rows])  # it did attend in bf16


@settings(max_examples=20, deadline=None)
@given(st.integers(PROMPT_LOW_MIN_TOKENS, 4 * PROMPT_LOW_BUCKET + PROMPT_LOW_MIN_TOKENS), st.integers(0, 2**31))
def test_padding_to_the_bucket_changes_nothing(length: int, seed: int) -> None:
    """The padded call equals bf16 SDPA over the exact length: zero rows after the last are
    invisible under the causal mask."""
    from tandem.engine.attention import _low_causal_sdpa, sdpa

    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 6, length, 32, generator=gen)
    k, v = (torch.randn(1, 2, length, 32, generator=gen) for _ in range(2))
    want = sdpa(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True, scale=0.2, enable_gqa=True).float()
    got = _low_causal_sdpa(q, k, v, torch.bfloat16, 0.2)
    assert got.shape == q.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)  # bf16 sums in another order at most
