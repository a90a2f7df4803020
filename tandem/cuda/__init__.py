"""The CUDA device backend: SM partitions as green contexts (``partition``), weights and KV
shared between processes through CUDA IPC handles that travel as bytes (``ipc``), decode under
CUDA graphs with look-ahead (``graphs``), the SMs' own ids for checking partitions (``smid``),
and the GPU profile behind ``tandem profile --device cuda`` (``profiler``).

Importing this package needs no GPU: every CUDA call is made when an object is built, and says
what is missing (no device, no cuda-bindings, no triton) in its error.
"""

# A CUDA cell's attention choices: decode_svc's --cuda-attention (its graph steps) and both
# services' --cuda-eager-attention (the steps they run op by op), both resolved by
# graphs.resolve_graph_attention. Here, where nothing is imported, for the services' flags.
CUDA_ATTENTION = ("auto", "flashinfer", "torch")
# flashinfer's by default for the eager steps where it can serve (fp16/bf16 pool, importable),
# torch's otherwise. Measured live on an H200 (2026-12-04, Llama-3.1-8B shape, random weights,
# docs/results/cuda-live-eager-attention-h200-1204-*.json): `chunked` at 6 req/s met both SLOs
# for 98-100 % of requests against 60-62 % with torch's (goodput 1.87x / 1.75x in two pairs),
# its hybrid steps' prompt parts no longer gathered row by row; `dynamic` at 12 req/s 1.08x /
# 1.02x (not separated). Its kernels are JIT-built on a machine's first use (about 2 minutes).
DEFAULT_EAGER_ATTENTION = "auto"
