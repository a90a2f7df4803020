"""Tandem's own C kernels against torch. RMSNorm (``ggml_kernels.rms_norm``) against
``F.rms_norm`` on random shapes. The paged decode attention (``ggml_kernels.paged_decode_attention``)
against the torch backend's gather-and-SDPA path, on random batches: both pool layouts, grouped-query heads, block
sizes, decode rows of mixed contexts beside prompt chunks (which stay on torch), rows in and out
of batch order, and blocks scattered through the pool. Built here if ``./dev`` has not built it.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.engine import ggml_kernels
from tandem.engine.attention import SeqSpan, TorchPagedAttention
from tandem.engine.kv_pool import KVPool, KVPoolSpec, PagedLayout
from tandem.engine.model import rms_norm


@pytest.fixture(scope="module", autouse=True)
def kernels() -> ggml_kernels.Kernels:
    return ggml_kernels.require()


def _batch(rng: random.Random, block_size: int, num_blocks: int, decode_only: bool) -> list[SeqSpan]:
    free = list(range(num_blocks))
    rng.shuffle(free)
    spans, row = [], 0
    # up to 20 rows: the kernel takes whole rows as work items from 2 rows a thread
    for _ in range(rng.randint(1, 20)):
        if not decode_only and rng.random() < 0.3:  # a prompt chunk, with or without a cached prefix
            q_len, cached = rng.randint(2, 9), rng.choice([0, rng.randint(1, 60)])
        else:
            q_len, cached = 1, rng.randint(0, 200)
        blocks = [free.pop() for _ in range(-(-(cached + q_len) // block_size))]
        spans.append(SeqSpan(row, q_len, cached, blocks))
        row += q_len
    return spans


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(["layer", "block"]), st.sampled_from([1, 2, 3, 4]), st.sampled_from([1, 2, 3, 4]),
       st.sampled_from([8, 64, 80, 128]), st.sampled_from([1, 5, 16]), st.booleans(),
       st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), st.integers(0, 2**31))
def test_c_decode_equals_torch_attention(layout: str, kv_heads: int, group: int, head_dim: int, block_size: int,
                                         decode_only: bool, kv_dtype: torch.dtype, seed: int) -> None:
    """Over a pool of any of the three KV dtypes: the kernel reads fp16 / bf16 as fp32, exactly."""
    rng = random.Random(seed)
    num_blocks = 20 * 260 // block_size + 8
    spec = KVPoolSpec(2, num_blocks, block_size, kv_heads, head_dim, kv_dtype, layout)
    pool = KVPool.create(spec)
    gen = torch.Generator().manual_seed(seed)
    pool.tensor.copy_(torch.randn(spec.shape, generator=gen))
    spans = _batch(rng, block_size, num_blocks, decode_only)
    tokens = sum(s.q_len for s in spans)
    q = torch.randn(tokens, kv_heads * group, head_dim, generator=gen)
    k, v = (torch.randn(tokens, kv_heads, head_dim, generator=gen) for _ in range(2))
    outs = []
    for c_decode in (True, False):
        backend = TorchPagedAttention(c_decode=c_decode)
        own = KVPool(spec, pool.tensor.clone())  # each path writes the new K/V into its own copy
        plan = backend.plan(spans, own)
        assert (plan.c_decode is not None) == (c_decode and any(s.q_len == 1 for s in spans))
        outs.append(backend.forward(1, q, k, v, plan, own))
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=1e-4)


@settings(max_examples=15, deadline=None)
@given(st.sampled_from(["layer", "block"]), st.integers(0, 2**31))
def test_c_decode_serves_half_precision_queries_over_an_fp32_pool(layout: str, seed: int) -> None:
    """A bf16 model over an fp32 KV pool (``--kv-dtype``): the kernel runs in fp32 and its rows
    are cast back; the torch path attends in bf16, hence bf16's tolerance."""
    rng = random.Random(seed)
    spec = KVPoolSpec(1, 20 * 260 // 16 + 8, 16, 2, 64, torch.float32, layout)
    pool = KVPool.create(spec)
    gen = torch.Generator().manual_seed(seed)
    pool.tensor.copy_(torch.randn(spec.shape, generator=gen))
    spans = _batch(rng, 16, spec.num_blocks, decode_only=False)
    tokens = sum(s.q_len for s in spans)
    q, k, v = (torch.randn(tokens, heads, 64, generator=gen).to(torch.bfloat16) for heads in (6, 2, 2))
    outs = []
    for c_decode in (True, False):
        backend = TorchPagedAttention(c_decode=c_decode)
        own = KVPool(spec, pool.tensor.clone())
        outs.append(backend.forward(0, q, k, v, backend.plan(spans, own), own))
    assert outs[0].dtype == torch.bfloat16
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=3e-2, rtol=3e-2)


def test_half_precision_pools_plan_on_c_and_the_switch_uses_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    spans = [SeqSpan(0, 1, 20, [0, 1])]
    pools = [KVPool.create(KVPoolSpec(1, 4, 16, 2, 8, dtype)) for dtype in (torch.float32, torch.float16, torch.bfloat16)]
    for pool in pools:  # built here: on by default, for each KV dtype
        assert TorchPagedAttention().plan(spans, pool).c_decode is not None
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "torch")
    for pool in pools:
        assert TorchPagedAttention().plan(spans, pool).c_decode is None


def test_other_cache_dtypes_are_refused(kernels: ggml_kernels.Kernels) -> None:
    k = torch.zeros(2, 16, 2, 8, dtype=torch.float64)
    layout = PagedLayout(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                         torch.tensor([3], dtype=torch.int32), 16)
    q, out = torch.zeros(1, 4, 8), torch.zeros(1, 4, 8)
    with pytest.raises(ValueError, match="fp32, fp16 or bf16"):
        kernels.paged_decode_attention(q, k, k.clone(), torch.zeros(1, dtype=torch.int64), layout, 1.0, out)


def test_heads_that_do_not_group_are_refused() -> None:
    kern = ggml_kernels.load()
    assert kern is not None
    cache = torch.zeros(2, 16, 2, 8)
    rows, layout = torch.zeros(1, dtype=torch.int64), PagedLayout.build([[0]], [3], 16)
    with pytest.raises(ValueError, match="cannot group 3 query heads over 2"):
        kern.paged_decode_attention(torch.zeros(1, 3, 8), cache, cache, rows, layout, 1.0, torch.zeros(1, 3, 8))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=3), st.sampled_from([1, 7, 64, 576, 2048]),
       st.floats(1e-6, 1e-2), st.integers(0, 2**31))
def test_rms_norm_equals_torch(lead: list[int], dim: int, eps: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, dim, generator=gen) * torch.rand(1, generator=gen).item() * 10
    weight = torch.randn(dim, generator=gen)
    if len(lead) > 1 and lead[0] > 1:
        x = x[::2]  # a strided view: the kernel reads a contiguous copy
    want = F.rms_norm(x, (dim,), weight, eps)
    assert ggml_kernels.own_kernels() is not None  # the model's rms_norm below runs the C kernel
    torch.testing.assert_close(rms_norm(x, weight, eps), want, atol=1e-5, rtol=1e-5)
