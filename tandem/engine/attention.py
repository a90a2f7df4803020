"""Paged attention backends behind one interface.

A forward pass over a batch calls ``plan`` once (block tables, slots, masks) and then
``forward`` once per layer. Every sequence in the batch contributes ``q_len`` new tokens
(prefill: the prompt or a chunk of it; decode: one) placed after ``num_cached`` tokens whose
K/V are already in the pool; ``forward`` first writes the new tokens' K/V into the pool and then
attends causally over cached + new tokens. One call therefore serves prefill, decode and hybrid
(chunked-prefill plus decode) batches alike.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tandem.engine.kv_pool import KVPool, slot_ids


@dataclass(frozen=True)
class SeqSpan:
    """One sequence's part of a batch, as the attention backend sees it."""

    q_start: int  # first row of this sequence's tokens in the batch's [num_tokens, ...] tensors
    q_len: int  # new tokens computed now
    num_cached: int  # tokens before them whose K/V are already in the pool
    block_ids: Sequence[int]  # covers at least num_cached + q_len tokens

    @property
    def kv_len(self) -> int:
        return self.num_cached + self.q_len


class AttentionBackend(ABC):
    """Contract: ``plan`` once per batch, then ``forward`` once per layer in any order of layers,
    possibly spread over several calls (layer groups); the plan stays valid until the next ``plan``."""

    name: str

    @abstractmethod
    def plan(self, spans: Sequence[SeqSpan], pool: KVPool) -> Any:
        """Build what ``forward`` needs for this batch; returns an opaque metadata object."""

    @abstractmethod
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any, pool: KVPool
    ) -> torch.Tensor:
        """q [num_tokens, num_heads, head_dim], k/v [num_tokens, num_kv_heads, head_dim]
        -> [num_tokens, num_heads, head_dim]; writes k/v into the pool first."""


@dataclass
class _TorchPlan:
    slots: torch.Tensor  # [num_tokens] int64
    # decode rows (q_len == 1), attended in one padded batch
    decode_rows: torch.Tensor | None  # [num_decode] int64 token rows
    decode_table: torch.Tensor | None  # [num_decode, max_blocks] int64, padded with a valid id
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_blocks * block_size] bool
    # multi-token rows, attended one sequence at a time
    prefill: list[tuple[int, int, int, torch.Tensor | None]]  # (q_start, q_len, num_cached, blocks)
    decode_only: bool = False  # every row is a decode row, in order: no row gather/scatter needed


class TorchPagedAttention(AttentionBackend):
    """The reference backend: plain torch over the paged pool (CPU or CUDA)."""

    name = "torch"

    def plan(self, spans: Sequence[SeqSpan], pool: KVPool) -> _TorchPlan:
        block_size = pool.spec.block_size
        slots: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefill: list[tuple[int, int, int, torch.Tensor | None]] = []
        for span in spans:
            slots.extend(slot_ids(span.block_ids, span.num_cached, span.kv_len, block_size))
            num_blocks = -(-span.kv_len // block_size)
            if span.q_len == 1:
                decode_rows.append(span.q_start)
                decode_tables.append(list(span.block_ids[:num_blocks]))
                decode_lens.append(span.kv_len)
            else:
                blocks = (
                    torch.tensor(span.block_ids[:num_blocks], dtype=torch.int64) if span.num_cached else None
                )
                prefill.append((span.q_start, span.q_len, span.num_cached, blocks))
        rows = table = mask = None
        if decode_rows:
            max_blocks = max(len(t) for t in decode_tables)
            pad = decode_tables[0][0]
            table = torch.tensor([t + [pad] * (max_blocks - len(t)) for t in decode_tables], dtype=torch.int64)
            positions = torch.arange(max_blocks * block_size)
            mask = (positions[None, :] < torch.tensor(decode_lens)[:, None])[:, None, None, :]
            rows = torch.tensor(decode_rows, dtype=torch.int64)
        decode_only = not prefill and decode_rows == list(range(len(decode_rows)))
        return _TorchPlan(torch.tensor(slots, dtype=torch.int64), rows, table, mask, prefill, decode_only)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any, pool: KVPool
    ) -> torch.Tensor:
        plan: _TorchPlan = meta
        pool.write(layer, plan.slots, k, v)
        k_cache, v_cache = pool.k_cache(layer), pool.v_cache(layer)  # [num_blocks, bs, kvh, d]
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        scale = 1.0 / math.sqrt(head_dim)
        out = torch.empty_like(q)
        if plan.decode_rows is not None:
            assert plan.decode_table is not None and plan.decode_mask is not None
            num_decode = plan.decode_rows.numel()
            # [num_decode, max_blocks * bs, kvh, d] -> [num_decode, kvh, S, d]
            keys = k_cache[plan.decode_table].view(num_decode, -1, num_kv_heads, head_dim).transpose(1, 2)
            values = v_cache[plan.decode_table].view(num_decode, -1, num_kv_heads, head_dim).transpose(1, 2)
            queries = (q if plan.decode_only else q[plan.decode_rows]).unsqueeze(2)  # [num_decode, H, 1, d]
            attn = F.scaled_dot_product_attention(
                queries, keys.to(q.dtype), values.to(q.dtype), attn_mask=plan.decode_mask, scale=scale, enable_gqa=True
            )
            if plan.decode_only:
                return attn.squeeze(2)
            out[plan.decode_rows] = attn.squeeze(2)
        for q_start, q_len, num_cached, blocks in plan.prefill:
            q_end = q_start + q_len
            queries = q[q_start:q_end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, d]
            if blocks is None:
                # Nothing cached: the new K/V are the whole context, no gather needed.
                keys = k[q_start:q_end].transpose(0, 1).unsqueeze(0)
                values = v[q_start:q_end].transpose(0, 1).unsqueeze(0)
                attn = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale, enable_gqa=True)
            else:
                kv_len = num_cached + q_len
                keys = k_cache[blocks].view(-1, num_kv_heads, head_dim)[:kv_len].transpose(0, 1).unsqueeze(0)
                values = v_cache[blocks].view(-1, num_kv_heads, head_dim)[:kv_len].transpose(0, 1).unsqueeze(0)
                # query i sits at absolute position num_cached + i and sees keys 0..num_cached + i
                mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(diagonal=num_cached)
                attn = F.scaled_dot_product_attention(
                    queries, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True
                )
            out[q_start:q_end] = attn.squeeze(0).transpose(0, 1)
        return out


def make_backend(name: str, num_qo_heads: int) -> AttentionBackend:
    """``torch`` (anywhere) or ``flashinfer`` (CUDA only; imported on first use)."""
    if name == "torch":
        return TorchPagedAttention()
    if name == "flashinfer":
        from tandem.engine.attention_flashinfer import FlashInferAttention

        return FlashInferAttention(num_qo_heads)
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch' or 'flashinfer'")
