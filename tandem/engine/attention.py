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
from torch.nn.attention import SDPBackend, sdpa_kernel

from tandem.engine import ggml_kernels
from tandem.engine.kv_pool import KVPool, PagedLayout, slot_ids


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

    def decodes_in_c(self, pool: KVPool) -> bool:
        """Whether this backend plans decode rows over ``pool`` on Tandem's C kernel, the
        attention ``ggml_kernels.DecodeLayers`` needs (see ``decode_tables``)."""
        return False

    def decode_tables(self, meta: Any) -> tuple[torch.Tensor, PagedLayout] | None:
        """For a plan of decode rows alone, in batch order, whose attention runs in Tandem's C
        kernel: their slots (int64) and the CSR block table, for ``ggml_kernels.DecodeLayers``,
        which runs such a step's layers whole. None for any other plan or backend."""
        return None


# cuDNN's attention builds an execution plan for every new shape, and a live batch's shapes change
# every step (contexts grow by a token): on an H100 each call spent 2.1 ms of host time planning,
# which made a decode step ten times slower in the service than in a benchmark that repeats one
# shape. On CUDA the other backends run instead (flash, memory-efficient, math: chosen by torch).
_CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """``F.scaled_dot_product_attention``, without cuDNN's backend on CUDA (see above)."""
    if query.is_cuda:
        with sdpa_kernel(_CUDA_SDPA_BACKENDS):
            return F.scaled_dot_product_attention(query, key, value, **kwargs)
    return F.scaled_dot_product_attention(query, key, value, **kwargs)


def gqa_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
             scale: float) -> torch.Tensor:
    """Attention of ``query`` [B, H, L, d] over ``key``/``value`` [B, kvh, S, d] (H a multiple
    of kvh: grouped-query attention) under a boolean ``attn_mask`` broadcast to [B, 1, L, S].

    On CUDA with a mask, each group's H / kvh query heads become that many times the queries of
    one head ([B, kvh, (H / kvh) L, d]), so no backend repeats K and V per query head (torch's
    math backend does, for ``enable_gqa``: gigabytes for a large decode batch, which a CUDA graph
    then keeps) and the memory-efficient kernel, which takes a mask, can run. Elsewhere, and
    without a mask (flash attention groups natively), ``enable_gqa``."""
    if not query.is_cuda or attn_mask is None:
        return sdpa(query, key, value, attn_mask=attn_mask, scale=scale, enable_gqa=True)
    return grouped_sdpa(query, key, value, attn_mask, scale)


def grouped_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """``gqa_sdpa``'s CUDA path (any device): each kv head's query heads as its queries."""
    b, h, length, d = query.shape
    kvh = key.shape[1]
    group = h // kvh
    mask = attn_mask.reshape(-1, 1, *attn_mask.shape[-2:])  # [B or 1, 1, L or 1, S]
    if length > 1:
        mask = mask.repeat(1, 1, group, 1)  # row j * L + l of a group is query l
    out = sdpa(query.reshape(b, kvh, group * length, d), key, value, attn_mask=mask, scale=scale)
    return out.reshape(b, h, length, d)


# Decode rows are attended in groups of similar context length, each padded to its longest
# member: a group may hold at most this much padding over its real tokens, and a batch is cut
# into at most _MAX_DECODE_GROUPS groups (ops per layer grow with the group count, padded work
# with the spread of lengths; a few groups bound both).
_MAX_PADDING_RATIO = 1.25
_MAX_DECODE_GROUPS = 4


@dataclass
class _DecodeGroup:
    """Decode rows (q_len == 1) attended in one padded SDPA call."""

    rows: torch.Tensor  # [n] int64 token rows of the batch
    num_rows: int
    flat_blocks: torch.Tensor  # [n * max_blocks] int64, each row's table padded with a valid id
    mask: torch.Tensor | None  # [n, 1, 1, max_blocks * block_size] bool; None: a lone row, sliced
    kv_len: int  # a lone row's context length (its keys are sliced to it)


@dataclass
class _TorchPlan:
    slots: torch.Tensor  # [num_tokens] int64
    decode: list[_DecodeGroup]
    # multi-token rows, attended one sequence at a time: (q_start, q_len, num_cached, blocks, mask)
    prefill: list[tuple[int, int, int, torch.Tensor | None, torch.Tensor | None]]
    only_rows_in_order: bool = False  # one decode group holding every row in order: no scatter
    # every decode row for the C kernel (``decode`` then empty): their batch rows (int64) and
    # block tables; None: the torch groups above
    c_decode: tuple[torch.Tensor, PagedLayout] | None = None
    rows_in_order: bool = False  # c_decode's rows are the batch's rows 0..n-1


# A prompt with nothing cached attends in the backend's ``prompt_dtype`` (bf16) from this many
# tokens, its rows padded with zeros to a multiple of PROMPT_LOW_BUCKET: torch's CPU SDPA in bf16
# (AMX) sets up its kernels for each new length, a first call 2-4x the next (1-5 ms a layer), so
# prompts of every length would pay it; zero rows after the last are invisible to the rows
# before them under the causal mask. Under 256 tokens bf16 was no faster (bench/prompt_attention.py).
PROMPT_LOW_MIN_TOKENS = 256
PROMPT_LOW_BUCKET = 64


def _low_causal_sdpa(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype,
                     scale: float) -> torch.Tensor:
    """Causal SDPA of [1, heads, L, d] tensors in ``dtype``, L padded up to PROMPT_LOW_BUCKET;
    the result [1, H, L, d] in the queries' dtype."""
    length = queries.shape[2]
    pad = -length % PROMPT_LOW_BUCKET

    def low(x: torch.Tensor) -> torch.Tensor:
        return F.pad(x.to(dtype), (0, 0, 0, pad)) if pad else x.to(dtype)

    attn = sdpa(low(queries), low(keys), low(values), is_causal=True, scale=scale, enable_gqa=True)
    return attn[:, :, :length].to(queries.dtype)


def _as_stored(x: torch.Tensor, pool: KVPool) -> torch.Tensor:
    """``x`` (new K or V) as the pool reads it back: rounded to its dtype unless that is wider
    (fp32 holds fp16 and bf16 exactly; fp16 and bf16 lose bits to each other both ways). Without
    it a prompt computed in one step would attend to K/V its later chunks, its decode steps and
    the C kernels never see, and greedy outputs would depend on how it was chunked."""
    stored = pool.spec.dtype
    return x if stored == x.dtype or stored.itemsize > x.dtype.itemsize else x.to(stored).to(x.dtype)


def group_by_length(lengths: Sequence[int], block_size: int) -> list[list[int]]:
    """Indices of ``lengths`` cut into padded-attention groups: longest first, a group grows
    while its padded size (members x its longest member, in blocks) stays within
    ``_MAX_PADDING_RATIO`` of its members' real tokens; the last allowed group takes the rest.
    Each group lists its members in ascending index order."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    padded = real = 0
    for i in order:
        blocks = -(-lengths[i] // block_size)
        if groups and (len(groups) == _MAX_DECODE_GROUPS
                       or (len(groups[-1]) + 1) * padded <= _MAX_PADDING_RATIO * (real + lengths[i])):
            groups[-1].append(i)
            real += lengths[i]
        else:
            groups.append([i])
            padded, real = blocks * block_size, lengths[i]
    return [sorted(g) for g in groups]  # members in batch order: one group of all needs no scatter


class TorchPagedAttention(AttentionBackend):
    """The reference backend: plain torch over the paged pool (CPU or CUDA).

    Decode rows are gathered from the pool by block (``index_select``) in a few groups of similar
    length, so a batch of mixed contexts is not padded to its longest one; prompt rows attend
    one sequence at a time, causally (over the new K/V alone when nothing is cached).
    """

    name = "torch"

    def __init__(self, c_decode: bool | None = None) -> None:
        """``c_decode``: decode rows of an fp32, fp16 or bf16 pool on the CPU attend in Tandem's C kernel
        (``ggml_kernels.paged_decode_attention``: read in place, no gather, no padding). None:
        when ``ggml_kernels.own_kernels()`` has them (built here, not turned off)."""
        if c_decode is None:
            self._kernels = ggml_kernels.own_kernels()
        else:
            self._kernels = ggml_kernels.load() if c_decode else None
        # fp32 prompts with nothing cached, of PROMPT_LOW_MIN_TOKENS or more, attend in this dtype
        # when set (``LlamaModel`` sets bf16 where its projections' wide copy is bf16:
        # ``model.prompt_attention_dtype``); other prompt rows and decode rows never.
        self.prompt_dtype: torch.dtype | None = None

    def _c_kernels(self, pool: KVPool) -> ggml_kernels.Kernels | None:
        if pool.spec.dtype not in ggml_kernels.KV_TYPES or pool.tensor.device.type != "cpu":
            return None
        return self._kernels

    def decodes_in_c(self, pool: KVPool) -> bool:
        return self._c_kernels(pool) is not None

    def plan(self, spans: Sequence[SeqSpan], pool: KVPool) -> _TorchPlan:
        block_size = pool.spec.block_size
        dev = pool.tensor.device  # plans are built on the host and copied once to the pool's device
        slots: list[int] = []
        decode: list[SeqSpan] = []
        prefill: list[tuple[int, int, int, torch.Tensor | None, torch.Tensor | None]] = []
        for span in spans:
            slots.extend(slot_ids(span.block_ids, span.num_cached, span.kv_len, block_size))
            num_blocks = -(-span.kv_len // block_size)
            if span.q_len == 1:
                decode.append(span)
            elif span.num_cached:
                blocks = torch.tensor(span.block_ids[:num_blocks], dtype=torch.int64, device=dev)
                # query i sits at absolute position num_cached + i and sees keys 0..num_cached + i
                mask = torch.ones(span.q_len, span.kv_len, dtype=torch.bool, device=dev).tril(diagonal=span.num_cached)
                prefill.append((span.q_start, span.q_len, span.num_cached, blocks, mask))
            else:
                prefill.append((span.q_start, span.q_len, 0, None, None))
        slot_tensor = torch.tensor(slots, dtype=torch.int64, device=dev)
        starts = [s.q_start for s in decode]
        in_order = starts == list(range(len(decode)))  # the decode rows are the batch's first rows
        if decode and self._c_kernels(pool) is not None:
            rows = torch.tensor(starts, dtype=torch.int64)
            layout = PagedLayout.build([s.block_ids for s in decode], [s.kv_len for s in decode], block_size)
            return _TorchPlan(slot_tensor, [], prefill, c_decode=(rows, layout), rows_in_order=in_order)
        groups = [self._decode_group([decode[i] for i in members], block_size, dev)
                  for members in group_by_length([s.kv_len for s in decode], block_size)]
        return _TorchPlan(slot_tensor, groups, prefill, not prefill and len(groups) == 1 and in_order)

    def decode_tables(self, meta: Any) -> tuple[torch.Tensor, PagedLayout] | None:
        plan: _TorchPlan = meta
        if plan.c_decode is None or plan.prefill or not plan.rows_in_order:
            return None
        return plan.slots, plan.c_decode[1]

    @staticmethod
    def _decode_group(spans: list[SeqSpan], block_size: int, dev: torch.device) -> _DecodeGroup:
        tables = [list(s.block_ids[: -(-s.kv_len // block_size)]) for s in spans]
        max_blocks = max(len(t) for t in tables)
        flat = [b for t in tables for b in t + [t[0]] * (max_blocks - len(t))]
        mask = None
        if len(spans) > 1:
            positions = torch.arange(max_blocks * block_size)
            lens = torch.tensor([s.kv_len for s in spans])
            mask = (positions[None, :] < lens[:, None])[:, None, None, :].to(dev)
        rows = torch.tensor([s.q_start for s in spans], dtype=torch.int64, device=dev)
        return _DecodeGroup(rows, len(spans), torch.tensor(flat, dtype=torch.int64, device=dev), mask, spans[0].kv_len)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any, pool: KVPool
    ) -> torch.Tensor:
        plan: _TorchPlan = meta
        pool.write(layer, plan.slots, k, v)
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        scale = 1.0 / math.sqrt(head_dim)
        if plan.only_rows_in_order:
            return self._attend_decode(plan.decode[0], q, pool, layer, scale).squeeze(2)
        out = torch.empty_like(q)
        if plan.c_decode is not None:
            assert self._kernels is not None  # planned with them
            rows, layout = plan.c_decode
            q32 = q.float().contiguous()
            out32 = out if out.dtype == torch.float32 else torch.empty_like(q32)
            self._kernels.paged_decode_attention(q32, pool.k_cache(layer), pool.v_cache(layer), rows, layout, scale,
                                                 out32)
            if out32 is not out:
                out.index_copy_(0, rows, out32.index_select(0, rows).to(out.dtype))
        for group in plan.decode:
            attn = self._attend_decode(group, q.index_select(0, group.rows), pool, layer, scale).squeeze(2)
            out.index_copy_(0, group.rows, attn)
        low = self.prompt_dtype if self.prompt_dtype is not None and q.dtype == torch.float32 else None
        for q_start, q_len, num_cached, blocks, mask in plan.prefill:
            q_end = q_start + q_len
            queries = q[q_start:q_end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, d]
            if blocks is None:
                # Nothing cached: the new K/V are the whole context, no gather needed; rounded as
                # the pool stores them (fp16 / bf16), as a chunk's or a decode row's reads see them.
                keys = _as_stored(k[q_start:q_end], pool).transpose(0, 1).unsqueeze(0)
                values = _as_stored(v[q_start:q_end], pool).transpose(0, 1).unsqueeze(0)
                if low is not None and q_len >= PROMPT_LOW_MIN_TOKENS:
                    attn = _low_causal_sdpa(queries, keys, values, low, scale)
                else:
                    attn = sdpa(queries, keys, values, is_causal=True, scale=scale, enable_gqa=True)
            else:
                kv_len = num_cached + q_len
                # [2, n_blocks, bs, kvh, d] -> [2, 1, kvh, kv_len, d]
                kv = pool.gather(layer, blocks).view(2, -1, num_kv_heads, head_dim)[:, :kv_len]
                kv = kv.transpose(1, 2).unsqueeze(1).to(q.dtype)
                attn = gqa_sdpa(queries, kv[0], kv[1], mask, scale)
            out[q_start:q_end] = attn.squeeze(0).transpose(0, 1)
        return out

    @staticmethod
    def _attend_decode(group: _DecodeGroup, queries: torch.Tensor, pool: KVPool, layer: int, scale: float) -> torch.Tensor:
        """queries [n, H, d] -> [n, H, 1, d] over each row's context, gathered block by block."""
        n, num_kv_heads, head_dim = group.num_rows, pool.spec.num_kv_heads, pool.spec.head_dim
        # [2, n * max_blocks, bs, kvh, d] -> [2, n, S, kvh, d]
        kv = pool.gather(layer, group.flat_blocks).view(2, n, -1, num_kv_heads, head_dim)
        if group.mask is None:  # a lone row: drop the last block's unwritten tail instead of masking
            kv = kv[:, :, : group.kv_len]
        kv = kv.transpose(2, 3)  # [2, n, kvh, S, d]
        if kv.dtype != queries.dtype:
            kv = kv.to(queries.dtype)
        return gqa_sdpa(queries.unsqueeze(2), kv[0], kv[1], group.mask, scale)


def make_backend(name: str, num_qo_heads: int) -> AttentionBackend:
    """``torch`` (anywhere) or ``flashinfer`` (CUDA only; imported on first use)."""
    if name == "torch":
        return TorchPagedAttention()
    if name == "flashinfer":
        from tandem.engine.attention_flashinfer import FlashInferAttention

        return FlashInferAttention(num_qo_heads)
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch' or 'flashinfer'")
