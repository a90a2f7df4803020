"""flashinfer paged attention (CUDA only). Checked against the torch backend on an H200 with
flashinfer 0.5.3 (``tests/gpu/test_flashinfer.py``); a CUDA cell's services run their eager
steps with it when asked (``--cuda-eager-attention flashinfer`` or ``auto``).

Written to flashinfer's documented wrapper API: one ``BatchPrefillWithPagedKVCacheWrapper``
serves prefill, decode and hybrid batches alike (a decode row is a query of length 1 with a
causal mask over its whole context), planned once per batch and run per layer against the
pool's ``(k_cache, v_cache)`` NHD tuple. A wrapper holds its plan, so each live plan has a
wrapper of its own (a batch paused between layer groups keeps its plan while a preempting batch
plans and runs), and goes back to the free ones when its plan is dropped; all share one split-K
workspace, as their runs never overlap. New K/V go in with ``append_paged_kv_cache``. The
module is imported only when the backend is chosen, so CPU-only machines never import flashinfer.

Wrappers are built, planned and run in inference mode, whatever mode the caller is in. A wrapper
allocates its buffers once (``_kv_lens_buffer`` and others, flashinfer 0.5.3) and copies each
plan's lengths into them. One built by ``ModelRunner.forward`` (inference mode) holds inference
tensors, and a later plan of prefill_svc's ``begin`` outside inference mode failed its copy
("Inplace update to inference tensor outside InferenceMode", H200, 2026-12-04): the prefill batch
failed. Inside inference mode, in-place updates of both kinds of tensor are allowed.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch

from tandem.engine.attention import AttentionBackend, SeqSpan
from tandem.engine.kv_pool import KVPool, PagedLayout

_WORKSPACE_BYTES = 128 * 1024 * 1024


@dataclass
class _FlashInferPlan:
    indptr: torch.Tensor  # [batch + 1] int32, on device
    indices: torch.Tensor  # [total_blocks] int32
    last_page_len: torch.Tensor  # [batch] int32
    batch_indices: torch.Tensor  # [num_tokens] which sequence each new token belongs to
    positions: torch.Tensor  # [num_tokens] its position in that sequence
    wrapper: Any  # flashinfer.BatchPrefillWithPagedKVCacheWrapper, planned for this batch


class FlashInferAttention(AttentionBackend):
    name = "flashinfer"

    def __init__(self, num_qo_heads: int, device: str | torch.device = "cuda") -> None:
        import flashinfer  # lazy: CUDA-only dependency

        self._fi = flashinfer
        self.num_qo_heads = num_qo_heads
        self.device = torch.device(device)
        with torch.inference_mode():
            self._workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._free: list[Any] = []  # wrappers no live plan holds
        self.num_wrappers = 0

    def _take_wrapper(self) -> Any:
        if self._free:
            return self._free.pop()
        self.num_wrappers += 1
        return self._fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")

    @torch.inference_mode()
    def plan(self, spans: Sequence[SeqSpan], pool: KVPool) -> Any:
        spec = pool.spec
        layout = PagedLayout.build([s.block_ids for s in spans], [s.kv_len for s in spans], spec.block_size)
        dev = self.device
        qo_indptr = torch.tensor([0, *accumulate(s.q_len for s in spans)], dtype=torch.int32, device=dev)
        indptr, indices, last = (t.to(dev) for t in (layout.indptr, layout.indices, layout.last_page_len))
        wrapper = self._take_wrapper()
        wrapper.plan(
            qo_indptr, indptr, indices, last,
            self.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.block_size,
            causal=True, q_data_type=spec.dtype, kv_data_type=spec.dtype,
        )
        seq_lens = torch.tensor([s.kv_len for s in spans], dtype=torch.int32, device=dev)
        num_tokens = sum(s.q_len for s in spans)
        batch_indices, positions = self._fi.get_batch_indices_positions(qo_indptr, seq_lens, num_tokens)
        plan = _FlashInferPlan(indptr, indices, last, batch_indices, positions, wrapper)
        weakref.finalize(plan, self._free.append, wrapper)  # the batch is done with it
        return plan

    @torch.inference_mode()
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any, pool: KVPool
    ) -> torch.Tensor:
        plan: _FlashInferPlan = meta
        cache = (pool.k_cache(layer), pool.v_cache(layer))
        self._fi.append_paged_kv_cache(
            k, v, plan.batch_indices, plan.positions, cache, plan.indices, plan.indptr, plan.last_page_len,
            kv_layout="NHD",
        )
        out: torch.Tensor = plan.wrapper.run(q, cache)
        return out
