"""flashinfer's paged attention agrees with the torch backend on prefill, decode and hybrid
batches (skipped, with the reason, where flashinfer is not installed)."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("seed", range(3))
def test_flashinfer_agrees_with_torch_attention(seed: int) -> None:
    pytest.importorskip("flashinfer", reason="flashinfer is not installed on this machine")
    from tandem.engine.attention import SeqSpan, make_backend
    from tandem.engine.kv_pool import KVPool, KVPoolSpec

    rng = random.Random(seed)
    heads, kv_heads, d, bs, blocks = 8, 2, 64, 16, 64
    pools = [KVPool.create(KVPoolSpec(1, blocks, bs, kv_heads, d, torch.float16), "cuda") for _ in range(2)]
    pools[1].tensor.copy_(pools[0].tensor.normal_())
    spans, start, free = [], 0, list(range(blocks))
    rng.shuffle(free)
    for _ in range(rng.randrange(2, 6)):
        q_len = rng.choice([1, 1, rng.randrange(2, 40)])
        cached = rng.randrange(0, 60)
        need = -(-(cached + q_len) // bs)
        spans.append(SeqSpan(start, q_len, cached, [free.pop() for _ in range(need)]))
        start += q_len
    q = torch.randn(start, heads, d, device="cuda", dtype=torch.float16)
    k = torch.randn(start, kv_heads, d, device="cuda", dtype=torch.float16)
    v = torch.randn(start, kv_heads, d, device="cuda", dtype=torch.float16)
    outs = []
    for name, pool in zip(("torch", "flashinfer"), pools):
        backend = make_backend(name, heads)
        outs.append(backend.forward(0, q, k, v, backend.plan(spans, pool), pool))
    torch.testing.assert_close(outs[1], outs[0], rtol=2e-2, atol=2e-2)
