"""The CUDA device backend: SM partitions as green contexts (``partition``), weights and KV
shared between processes through CUDA IPC handles that travel as bytes (``ipc``), decode under
CUDA graphs with look-ahead (``graphs``), the SMs' own ids for checking partitions (``smid``),
and the GPU profile behind ``tandem profile --device cuda`` (``profiler``).

Importing this package needs no GPU: every CUDA call is made when an object is built, and says
what is missing (no device, no cuda-bindings, no triton) in its error.
"""
