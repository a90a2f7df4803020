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
# torch's by default for the eager steps: flashinfer's agreed with it on an H200
# (tests/gpu/test_flashinfer.py, a paused batch's plan kept through a preempting one too), but the
# stack with it has not been measured live (its kernels' JIT build took 86 s of the services'
# start on a fresh machine, and that call's device time ran out before the first request).
DEFAULT_EAGER_ATTENTION = "torch"
