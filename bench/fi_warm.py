"""JIT-build the flashinfer kernels a CUDA cell's services use, before a GPU call's measured
stages start them (docs/gpu.md, ``bench/gpu_run.sh fiwarm``): flashinfer builds each kernel
with the machine's nvcc the first time a process plans it, and a service that builds at start
takes a minute or more longer to serve.

    python3 -m bench.fi_warm DTYPE:HEADS:KV_HEADS:HEAD_DIM ...

For each shape: the paged decode wrapper decode_svc's graph steps plan (``--cuda-attention``),
and the paged prefill kernel with its K/V append that the steps run op by op plan and run
(``--cuda-eager-attention``), both through the code the services run."""

from __future__ import annotations

import sys
import time

import torch

from tandem.cuda.graphs import FlashInferPlans
from tandem.engine.attention import SeqSpan, make_backend
from tandem.engine.kv_pool import KVPool, KVPoolSpec, PagedLayout

BLOCK_SIZE = 16


def warm(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    pool = KVPool.create(KVPoolSpec(1, 8, BLOCK_SIZE, kv_heads, head_dim, dtype), "cuda")
    decode = FlashInferPlans(pool, heads, max_blocks=4)
    decode.plan(1, [PagedLayout.build([[0, 1]], [20], BLOCK_SIZE)])
    backend = make_backend("flashinfer", heads)
    spans = [SeqSpan(0, 20, 0, [2, 3]), SeqSpan(20, 1, 30, [4, 5])]  # a prompt and a decode row
    q = torch.randn(21, heads, head_dim, device="cuda", dtype=dtype)
    k, v = (torch.randn(21, kv_heads, head_dim, device="cuda", dtype=dtype) for _ in range(2))
    backend.forward(0, q, k, v, backend.plan(spans, pool), pool)
    torch.cuda.synchronize()


def main(shapes: list[str]) -> None:
    for shape in shapes:
        name, *dims = shape.split(":")
        started = time.perf_counter()
        heads, kv_heads, head_dim = map(int, dims)
        warm(getattr(torch, name), heads, kv_heads, head_dim)
        print(f"flashinfer kernels of {shape} built in {time.perf_counter() - started:.1f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
