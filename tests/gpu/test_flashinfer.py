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


@pytest.mark.parametrize("seed", range(2))
def test_a_paused_batchs_plan_survives_a_preempting_batch(seed: int) -> None:
    """prefill_svc pauses a long batch between layer groups and runs a short one: with
    flashinfer, the long batch's plan (made first) still gives torch's answer after the short
    batch planned and ran."""
    pytest.importorskip("flashinfer", reason="flashinfer is not installed on this machine")
    from tandem.engine.attention import SeqSpan, make_backend
    from tandem.engine.kv_pool import KVPool, KVPoolSpec

    rng = random.Random(100 + seed)
    heads, kv_heads, d, bs, blocks = 8, 2, 64, 16, 96
    pools = [KVPool.create(KVPoolSpec(1, blocks, bs, kv_heads, d, torch.float16), "cuda") for _ in range(2)]
    pools[1].tensor.copy_(pools[0].tensor.normal_())
    free = list(range(blocks))
    rng.shuffle(free)
    batches = []
    for q_len in (rng.randrange(200, 600), rng.randrange(4, 40)):  # the long batch, the short one
        span = SeqSpan(0, q_len, 0, [free.pop() for _ in range(-(-q_len // bs))])
        qkv = [torch.randn(q_len, h, d, device="cuda", dtype=torch.float16) for h in (heads, kv_heads, kv_heads)]
        batches.append(([span], qkv))
    torch_backend, fi = make_backend("torch", heads), make_backend("flashinfer", heads)
    want = [torch_backend.forward(0, *qkv, torch_backend.plan(spans, pools[0]), pools[0]) for spans, qkv in batches]
    plans = [fi.plan(spans, pools[1]) for spans, _ in batches]  # long planned first, then the short one
    got_short = fi.forward(0, *batches[1][1], plans[1], pools[1])
    got_long = fi.forward(0, *batches[0][1], plans[0], pools[1])
    torch.testing.assert_close(got_short, want[1], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got_long, want[0], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("seed", range(2))
def test_plans_in_and_out_of_inference_mode_on_one_wrapper(seed: int) -> None:
    """A wrapper built by a plan in inference mode (``ModelRunner.forward``) and planned again
    outside it (prefill_svc's ``begin`` before 2026-12-04) failed its plan on an H200. Planned in
    either mode in turn, on the one wrapper recycled, flashinfer still gives torch's answer."""
    pytest.importorskip("flashinfer", reason="flashinfer is not installed on this machine")
    import gc

    from tandem.engine.attention import SeqSpan, make_backend
    from tandem.engine.kv_pool import KVPool, KVPoolSpec

    rng = random.Random(200 + seed)
    heads, kv_heads, d, bs, blocks = 8, 2, 64, 16, 64
    pools = [KVPool.create(KVPoolSpec(1, blocks, bs, kv_heads, d, torch.bfloat16), "cuda") for _ in range(2)]
    pools[1].tensor.copy_(pools[0].tensor.normal_())
    torch_backend, fi = make_backend("torch", heads), make_backend("flashinfer", heads)
    for i in range(6):
        q_len = rng.randrange(1, 300)
        span = [SeqSpan(0, q_len, 0, rng.sample(range(blocks), -(-q_len // bs)))]
        qkv = [torch.randn(q_len, h, d, device="cuda", dtype=torch.bfloat16) for h in (heads, kv_heads, kv_heads)]
        want = torch_backend.forward(0, *qkv, torch_backend.plan(span, pools[0]), pools[0])
        if i % 2 == 0:
            with torch.inference_mode():
                got = fi.forward(0, *qkv, fi.plan(span, pools[1]), pools[1])
        else:
            got = fi.forward(0, *qkv, fi.plan(span, pools[1]), pools[1])
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        gc.collect()  # the plan is dropped: its wrapper is taken again by the next one
    assert fi.num_wrappers == 1
