"""The paged KV pool and the CSR block-table form shared by the CPU and GPU backends.

Pool layout: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` — for layer
``l``, ``pool[l, 0]`` and ``pool[l, 1]`` are contiguous K and V caches in flashinfer's NHD
layout (``(k_cache, v_cache)`` tuple form), so the flashinfer backend passes them unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.engine.config import ModelConfig
from tandem.engine.shm import SharedTensorStore

_POOL_KEY = "kv"


@dataclass(frozen=True)
class KVPoolSpec:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KV pool {name} must be positive, got {getattr(self, name)}")

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @classmethod
    def for_model(
        cls, config: ModelConfig, num_blocks: int, block_size: int = 16, dtype: torch.dtype = torch.float32
    ) -> KVPoolSpec:
        return cls(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim, dtype)


def num_blocks_for_budget(config: ModelConfig, kv_cache_bytes: int, block_size: int, dtype: torch.dtype) -> int:
    """How many blocks of ``config``'s K/V fit in ``kv_cache_bytes`` (at least one)."""
    return max(1, kv_cache_bytes // KVPoolSpec.for_model(config, 1, block_size, dtype).bytes_per_block)


class KVPool:
    """The K/V tensor; private (``create``), or in shared memory (``create_shared`` / ``attach``)."""

    def __init__(self, spec: KVPoolSpec, tensor: torch.Tensor, store: SharedTensorStore | None = None):
        if tuple(tensor.shape) != spec.shape:
            raise ValueError(f"KV tensor shape {tuple(tensor.shape)} does not match spec {spec.shape}")
        self.spec = spec
        self.tensor = tensor  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.store = store
        # Per-layer views, made once: K and V of a layer side by side, by block and by slot, so one
        # op writes or gathers both.
        self._kv = [tensor[layer] for layer in range(spec.num_layers)]  # [2, num_blocks, bs, kvh, d]
        self._kv_flat = [t.view(2, -1, spec.num_kv_heads, spec.head_dim) for t in self._kv]  # [2, slots, kvh, d]

    @classmethod
    def create(cls, spec: KVPoolSpec, device: str | torch.device = "cpu") -> KVPool:
        return cls(spec, torch.zeros(spec.shape, dtype=spec.dtype, device=device))

    @classmethod
    def create_shared(cls, spec: KVPoolSpec, name: str, exist_ok: bool = False) -> KVPool:
        store = SharedTensorStore.create(name, {_POOL_KEY: (spec.shape, spec.dtype)}, exist_ok=exist_ok)
        return cls(spec, store.tensors[_POOL_KEY], store)

    @classmethod
    def attach(cls, spec: KVPoolSpec, name: str) -> KVPool:
        store = SharedTensorStore.attach(name)
        return cls(spec, store.tensors[_POOL_KEY], store)

    def k_cache(self, layer: int) -> torch.Tensor:
        return self.tensor[layer, 0]  # [num_blocks, block_size, kvh, d]

    def v_cache(self, layer: int) -> torch.Tensor:
        return self.tensor[layer, 1]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of new tokens: ``slots`` [num_tokens] int64, k/v [num_tokens, kvh, d]."""
        self._kv_flat[layer].index_copy_(1, slots, torch.stack((k, v)).to(self.spec.dtype))

    def gather(self, layer: int, block_ids: torch.Tensor) -> torch.Tensor:
        """K and V of the given blocks, copied out: [2, len(block_ids), block_size, kvh, d]."""
        return self._kv[layer].index_select(1, block_ids)


@dataclass(frozen=True)
class PagedLayout:
    """Block tables of a batch in CSR form (flashinfer's ``paged_kv_indptr/indices/last_page_len``).

    Request ``i`` owns ``indices[indptr[i]:indptr[i+1]]``; its last block holds
    ``last_page_len[i]`` tokens (1..block_size).
    """

    indptr: torch.Tensor  # [batch_size + 1] int32
    indices: torch.Tensor  # [total_blocks] int32
    last_page_len: torch.Tensor  # [batch_size] int32
    block_size: int

    @classmethod
    def build(cls, block_tables: Sequence[Sequence[int]], seq_lens: Sequence[int], block_size: int) -> PagedLayout:
        indptr = [0]
        indices: list[int] = []
        last: list[int] = []
        for blocks, seq_len in zip(block_tables, seq_lens, strict=True):
            num_blocks = -(-seq_len // block_size)
            if seq_len <= 0 or num_blocks > len(blocks):
                raise ValueError(f"{len(blocks)} blocks cannot hold {seq_len} tokens of block size {block_size}")
            indices.extend(blocks[:num_blocks])
            indptr.append(len(indices))
            last.append(seq_len - (num_blocks - 1) * block_size)
        return cls(
            torch.tensor(indptr, dtype=torch.int32),
            torch.tensor(indices, dtype=torch.int32),
            torch.tensor(last, dtype=torch.int32),
            block_size,
        )

    @property
    def batch_size(self) -> int:
        return int(self.indptr.numel()) - 1

    def seq_lens(self) -> list[int]:
        counts = (self.indptr[1:] - self.indptr[:-1]).tolist()
        return [(n - 1) * self.block_size + int(last) for n, last in zip(counts, self.last_page_len.tolist())]

    def block_table(self, i: int) -> list[int]:
        return self.indices[int(self.indptr[i]) : int(self.indptr[i + 1])].tolist()


def slot_ids(block_ids: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Pool slots (block_id * block_size + offset) of token positions [start, end)."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]
