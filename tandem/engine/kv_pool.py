"""The paged KV pool and the CSR block-table form shared by the CPU and GPU backends.

Two layouts (``KVPoolSpec.layout``):

- ``"layer"`` (a cell of one model): ``[num_layers, 2, num_blocks, block_size, num_kv_heads,
  head_dim]`` — for layer ``l``, ``pool[l, 0]`` and ``pool[l, 1]`` are contiguous K and V caches
  in flashinfer's NHD layout (``(k_cache, v_cache)`` tuple form), so the flashinfer backend passes
  them unchanged.
- ``"block"`` (a cell of several models sharing one KV slab pool, ``tandem.engine.kv_slab``):
  ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` — each block is one
  contiguous run of ``bytes_per_block`` bytes, so block ``b`` of a model lies at byte
  ``b * bytes_per_block`` of the shared byte pool, which is what the slab's id rule
  (``slab_id * blocks_per_slab + local_id``) needs; models of different shapes and dtypes then
  view the same bytes each in its own layout, and only the slab allocator keeps them apart.

Attention only writes slots and gathers blocks (``write`` / ``gather``), so it runs unchanged on
either layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.engine.config import ModelConfig
from tandem.engine.shm import SharedTensorStore

_POOL_KEY = "kv"
LAYOUTS = ("layer", "block")


@dataclass(frozen=True)
class KVPoolSpec:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    layout: str = "layer"  # see the module docstring

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KV pool {name} must be positive, got {getattr(self, name)}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"KV pool layout must be one of {LAYOUTS}, got {self.layout!r}")

    @property
    def shape(self) -> tuple[int, ...]:
        per_block = (self.block_size, self.num_kv_heads, self.head_dim)
        if self.layout == "block":
            return (self.num_blocks, self.num_layers, 2, *per_block)
        return (self.num_layers, 2, self.num_blocks, *per_block)

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @classmethod
    def for_model(
        cls, config: ModelConfig, num_blocks: int, block_size: int = 16, dtype: torch.dtype = torch.float32,
        layout: str = "layer",
    ) -> KVPoolSpec:
        return cls(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim, dtype, layout)


def num_blocks_for_budget(config: ModelConfig, kv_cache_bytes: int, block_size: int, dtype: torch.dtype) -> int:
    """How many blocks of ``config``'s K/V fit in ``kv_cache_bytes`` (at least one)."""
    return max(1, kv_cache_bytes // KVPoolSpec.for_model(config, 1, block_size, dtype).bytes_per_block)


class KVPool:
    """The K/V tensor; private (``create``), or in shared memory (``create_shared`` / ``attach``).

    A pool of block layout may be a view of a byte pool that several models share
    (``create_byte_pool``); ``attach`` takes such a view too.
    """

    def __init__(self, spec: KVPoolSpec, tensor: torch.Tensor, store: SharedTensorStore | None = None):
        if tuple(tensor.shape) != spec.shape:
            raise ValueError(f"KV tensor shape {tuple(tensor.shape)} does not match spec {spec.shape}")
        self.spec = spec
        self.tensor = tensor  # spec.shape, in spec.layout
        self.store = store
        # Per-layer views, made once: K and V of a layer side by side, by block ([2, num_blocks, bs,
        # kvh, d]; strided in block layout) and, in layer layout, by slot ([2, slots, kvh, d]), so
        # one op writes both; K and V apart by block ([num_blocks, bs, kvh, d], a block's rows
        # contiguous in either layout), so a gather copies whole runs along dim 0 (index_select
        # over the strided K-and-V view of block layout is 12x slower, measured; in layer layout
        # either way costs the same).
        if spec.layout == "block":
            self._kv = [tensor[:, layer].transpose(0, 1) for layer in range(spec.num_layers)]
            self._kv_flat: list[torch.Tensor] | None = None
        else:
            self._kv = [tensor[layer] for layer in range(spec.num_layers)]
            self._kv_flat = [t.view(2, -1, spec.num_kv_heads, spec.head_dim) for t in self._kv]
        self._k_by_block = [kv[0] for kv in self._kv]
        self._v_by_block = [kv[1] for kv in self._kv]

    @classmethod
    def create(cls, spec: KVPoolSpec, device: str | torch.device = "cpu") -> KVPool:
        return cls(spec, torch.zeros(spec.shape, dtype=spec.dtype, device=device))

    @classmethod
    def create_shared(cls, spec: KVPoolSpec, name: str, exist_ok: bool = False) -> KVPool:
        store = SharedTensorStore.create(name, {_POOL_KEY: (spec.shape, spec.dtype)}, exist_ok=exist_ok)
        return cls(spec, store.tensors[_POOL_KEY], store)

    @classmethod
    def create_byte_pool(cls, name: str, num_bytes: int, exist_ok: bool = False) -> SharedTensorStore:
        """A shared pool of ``num_bytes`` raw bytes, for models to view each in its own block
        layout (``attach`` / ``view_of``)."""
        return SharedTensorStore.create(name, {_POOL_KEY: ((num_bytes,), torch.uint8)}, exist_ok=exist_ok)

    @classmethod
    def view_of(cls, spec: KVPoolSpec, store: SharedTensorStore, offset_bytes: int = 0) -> KVPool:
        """``spec``'s pool over the store's tensor: itself, or ``spec.num_bytes`` of a byte pool
        from ``offset_bytes`` on, reinterpreted in block layout (ValueError when it does not fit)."""
        raw = store.tensors[_POOL_KEY]
        if raw.dtype != torch.uint8 or raw.dim() != 1:
            return cls(spec, raw, store)
        if spec.layout != "block":
            raise ValueError("a shared byte pool is viewed in block layout only")
        if offset_bytes < 0 or offset_bytes % spec.dtype.itemsize:
            raise ValueError(f"a {spec.dtype} view cannot start at byte {offset_bytes}")
        if offset_bytes + spec.num_bytes > raw.numel():
            raise ValueError(f"{spec.num_blocks} blocks of {spec.bytes_per_block} bytes from byte {offset_bytes} "
                             f"do not fit a byte pool of {raw.numel()} bytes")
        window = raw[offset_bytes: offset_bytes + spec.num_bytes]
        return cls(spec, window.view(spec.dtype).view(spec.shape), store)

    @classmethod
    def attach(cls, spec: KVPoolSpec, name: str, offset_bytes: int = 0) -> KVPool:
        return cls.view_of(spec, SharedTensorStore.attach(name), offset_bytes)

    def k_cache(self, layer: int) -> torch.Tensor:
        return self._kv[layer][0]  # [num_blocks, block_size, kvh, d]

    def v_cache(self, layer: int) -> torch.Tensor:
        return self._kv[layer][1]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of new tokens: ``slots`` [num_tokens] int64, k/v [num_tokens, kvh, d]."""
        if self._kv_flat is not None:
            self._kv_flat[layer].index_copy_(1, slots, torch.stack((k, v)).to(self.spec.dtype))
            return
        size = self.spec.block_size
        self._kv[layer][:, slots // size, slots % size] = torch.stack((k, v)).to(self.spec.dtype)

    def gather(self, layer: int, block_ids: torch.Tensor) -> torch.Tensor:
        """K and V of the given blocks, copied out: [2, len(block_ids), block_size, kvh, d]."""
        k = self._k_by_block[layer]
        out = torch.empty((2, block_ids.numel(), *k.shape[1:]), dtype=k.dtype, device=k.device)
        torch.index_select(k, 0, block_ids, out=out[0])
        torch.index_select(self._v_by_block[layer], 0, block_ids, out=out[1])
        return out


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
