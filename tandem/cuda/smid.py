"""Which SMs a launch ran on: a Triton kernel whose blocks each write ``%smid``, the PTX register
that names the SM executing it. Used to check that partitions are what they claim (disjoint, of
the asked size) and that a switch takes effect at the next launch."""

from __future__ import annotations

from typing import Any

import torch

_KERNEL: Any = None


def _kernel() -> Any:
    global _KERNEL
    if _KERNEL is None:
        try:
            import triton
            import triton.language as tl
        except ImportError as exc:  # pragma: no cover - CUDA machines only
            raise RuntimeError("reading SM ids needs triton") from exc

        @triton.jit
        def smid_kernel(out_ptr, sink_ptr, n_spin):  # type: ignore[no-untyped-def]
            pid = tl.program_id(0)
            zero = tl.full([1], 0, tl.int32)
            sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [zero], dtype=tl.int32, is_pure=False, pack=1)
            acc = zero + pid
            for _ in range(n_spin):  # keep the block resident, so blocks spread over every SM allowed
                acc = acc * 1103515245 + 12345
            tl.store(out_ptr + pid + tl.arange(0, 1), sm)
            tl.store(sink_ptr + pid + tl.arange(0, 1), acc)

        _KERNEL = smid_kernel
    return _KERNEL


def launch_smid(num_blocks: int = 1024, spin: int = 20000, device: int = 0) -> torch.Tensor:
    """Launch on the current stream; returns the (not yet synchronised) [num_blocks] SM ids."""
    out = torch.full((num_blocks,), -1, dtype=torch.int32, device=device)
    sink = torch.empty(num_blocks, dtype=torch.int32, device=device)
    _kernel()[(num_blocks,)](out, sink, spin)
    return out


def sms_used(stream: torch.cuda.Stream, num_blocks: int = 1024, spin: int = 20000) -> set[int]:
    """The SMs a launch on ``stream`` ran on (synchronises the stream)."""
    with torch.cuda.stream(stream):
        out = launch_smid(num_blocks, spin, stream.device.index or 0)
    stream.synchronize()
    return set(out.tolist())
