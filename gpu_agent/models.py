"""The models a cell serves: their weights in shared memory, their view of the KV pool, their ledgers.

A cell of one model keeps the pool it always had: one layer-major tensor of that model's blocks
and a plain ``BlockAllocator``. A cell of several models (FineServe's co-location, section 5)
has one shared *byte* pool carved into slabs by ``tandem.engine.kv_slab.KVSlabPool``; each model
views the whole pool in block layout at its own block size and dtype, and allocates through its
own ``SlabBlockAllocator`` and ``BlockLedger``, so its block ids, prefix index and attention code
are those of a cell of its own, while free slabs go to whichever model needs them next.

``--model`` names the models (``tandem.service.model_spec``), e.g. ``default,default:kv=bfloat16``:
the default model twice, the second with a bf16 KV cache. Models of one checkpoint map one copy
of its weights.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gpu_agent.blocks import BlockLedger
from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.config import ModelConfig
from tandem.engine.errors import InvalidRequestError
from tandem.engine.kv_pool import KVPool, KVPoolSpec, num_blocks_for_budget
from tandem.engine.kv_slab import KVSlabPool
from tandem.engine.model_cache import resolve_model
from tandem.engine.quant import WeightFormat, effective_format
from tandem.engine.shm import SharedTensorStore
from tandem.engine.weight_format import default_kv_dtype
from tandem.engine.weights import load_checkpoint, parse_dtype, share_weights
from tandem.service.model_spec import ModelSpec

log = logging.getLogger("tandem.gpu_agent")


@dataclass
class ServedModel:
    """One model of the cell and everything a service computing it attaches to."""

    name: str
    model_dir: Path
    config: ModelConfig
    weights: SharedTensorStore | None  # None on a CUDA cell: cuda_weights
    kv: KVPoolSpec  # this model's view of the pool
    kv_offset: int  # where the view starts in the pool, in bytes
    dtype: str
    kv_dtype: str
    weight_format: WeightFormat
    ledger: BlockLedger
    cuda_weights: bytes = b""  # a CUDA cell: the weights' IPC handles (tandem.cuda.ipc)


@dataclass
class Cell:
    """The cell's models (the first is the default for services and callers that name none), the
    shared KV store and, with several models, the slab table over it."""

    models: dict[str, ServedModel]
    kv_store: SharedTensorStore | None  # None on a CUDA cell: cuda_kv
    slabs: KVSlabPool | None
    cuda_kv: bytes = b""  # a CUDA cell: the pool's IPC handle
    # A CUDA cell: the pool's last block, outside the allocator: decode's CUDA-graph steps write
    # the K/V of their padding rows there (tandem.cuda.graphs). None elsewhere.
    scratch_block: int | None = None
    # A CUDA cell's weights and pool: the exporter keeps them alive while any service maps them.
    device_tensors: list[object] = field(default_factory=list)

    @property
    def first(self) -> ServedModel:
        return next(iter(self.models.values()))

    def model(self, name: str) -> ServedModel:
        """The model named ``name``; "" is the first. InvalidRequestError names the choices."""
        if not name:
            return self.first
        try:
            return self.models[name]
        except KeyError:
            raise InvalidRequestError(f"this cell serves no model {name!r}; it serves {sorted(self.models)}") from None

    @property
    def kv_bytes(self) -> int:
        """The bytes of the cell's KV pool: the slab table's, or the models' views side by side."""
        if self.slabs is not None:
            return self.slabs.num_slabs * self.slabs.slab_bytes
        return sum(m.kv.num_bytes for m in self.models.values())

    def kv_used_by_model(self) -> dict[str, float]:
        """The fraction of the cell's KV bytes each model's held blocks take (they sum to the
        cell's use, whichever way the pool is split)."""
        total = self.kv_bytes
        return {name: m.ledger.allocator.num_used_blocks * m.kv.bytes_per_block / total if total else 0.0
                for name, m in self.models.items()}

    def kv_blocks_free(self) -> tuple[int, int]:
        """(free, total) KV blocks of the cell, counted in its first model's blocks (the model its
        policy predicts for): the pool's free share, whichever way it is split between models."""
        total = self.first.ledger.allocator.num_blocks
        used = sum(self.kv_used_by_model().values())
        return max(0, min(total, round((1.0 - used) * total))), total

    def ledgers(self) -> CellLedgers:
        return CellLedgers({name: m.ledger for name, m in self.models.items()})


class CellLedgers:
    """The per-model ledgers seen as one where a caller names a request or an owner, not a model:
    request ids and service ids are unique across the cell, and a service computes one model."""

    def __init__(self, ledgers: Mapping[str, BlockLedger]) -> None:
        self._ledgers = dict(ledgers)

    def __iter__(self) -> Iterator[BlockLedger]:
        return iter(self._ledgers.values())

    def of_request(self, request_id: str) -> BlockLedger:
        """The ledger holding ``request_id`` (the first when none does: its calls then fail as a
        one-model cell's would)."""
        return next((ledger for ledger in self if ledger.blocks_of(request_id) is not None),
                    next(iter(self._ledgers.values())))

    @property
    def num_requests(self) -> int:
        return sum(ledger.num_requests for ledger in self)

    @property
    def num_blocks_freed(self) -> int:
        """Blocks ever given back, every model's (with a slab pool, a block one model frees can
        free the slab another needs)."""
        return sum(ledger.num_blocks_freed for ledger in self)

    def owned_by(self, owner: str) -> list[str]:
        return [rid for ledger in self for rid in ledger.owned_by(owner)]

    def reclaim(self, owner: str) -> tuple[int, int]:
        requests = blocks = 0
        for ledger in self:
            r, b = ledger.reclaim(owner)
            requests, blocks = requests + r, blocks + b
        return requests, blocks


KV_SPLITS = ("slab", "static")


def build_cuda_cell(specs: tuple[ModelSpec, ...], *, dtype: str, kv_dtype: str, block_size: int, kv_cache_bytes: int,
                    num_blocks: int) -> Cell:
    """A cell of one model on the CUDA device: weights and KV pool allocated here, in GPU memory,
    and exported as CUDA IPC handles (``tandem.cuda.ipc``) that prefill and decode open. The
    weights run as they are (cuBLAS): the CPU weight formats do not apply."""
    import torch

    from tandem.cuda.ipc import export_tensors

    if len(specs) != 1:
        raise ValueError("a CUDA cell serves one model; several models per cell run on --device cpu")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible")
    spec = specs[0]
    model_dir = resolve_model(spec.path)
    config = ModelConfig.from_dir(model_dir)
    kv = spec.kv_dtype or kv_dtype or default_kv_dtype(spec.quantization, dtype, device="cuda")
    blocks = num_blocks or num_blocks_for_budget(config, kv_cache_bytes, block_size, parse_dtype(kv))
    # One block more than the allocator hands out: the scratch block of decode's graph steps.
    view = KVPoolSpec.for_model(config, blocks + 1, block_size, parse_dtype(kv))
    pool = KVPool.create(view, "cuda")
    weights = load_checkpoint(model_dir, config, parse_dtype(dtype), "cuda")
    name = spec.served_name(model_dir)
    model = ServedModel(name, model_dir, config, None, view, 0, dtype, kv, WeightFormat.FP32,
                        BlockLedger(BlockAllocator(blocks, block_size)), cuda_weights=export_tensors(weights))
    return Cell({name: model}, None, None, cuda_kv=export_tensors({"kv": pool.tensor}), scratch_block=blocks,
                device_tensors=[weights, pool])


def build_cell(specs: tuple[ModelSpec, ...], *, dtype: str, kv_dtype: str, quantization: str, block_size: int,
               kv_cache_bytes: int, num_blocks: int, shm_prefix: str, kv_split: str = "slab") -> Cell:
    """Load every model's weights into shared memory and create the KV pool (the slow part).

    ``num_blocks`` (if not 0) sizes the pool in blocks of the first model; else ``kv_cache_bytes``.
    With several models, ``kv_split`` "slab" shares the pool through slabs; "static" gives each
    model an equal range of its own (the baseline FineServe compares against), with a plain
    allocator over it.
    """
    if kv_split not in KV_SPLITS:
        raise ValueError(f"--kv-split must be one of {KV_SPLITS}, got {kv_split!r}")
    loaded: list[tuple[ModelSpec, Path, ModelConfig, str]] = []
    names: list[str] = []  # served names, in the order of ``loaded``
    for spec in specs:
        model_dir = resolve_model(spec.path)
        name = spec.served_name(model_dir)
        if name in names:
            raise ValueError(f"two --model entries serve the name {name!r}; give one of them :name=NAME")
        names.append(name)
        kv = spec.kv_dtype or kv_dtype or default_kv_dtype(spec.quantization or quantization, dtype)
        loaded.append((spec, model_dir, ModelConfig.from_dir(model_dir), kv))
    first_config, first_kv = loaded[0][2], parse_dtype(loaded[0][3])
    pool_bytes = (num_blocks * KVPoolSpec.for_model(first_config, 1, block_size, first_kv).bytes_per_block
                  if num_blocks else kv_cache_bytes)
    slabs: KVSlabPool | None = None
    offsets = [0] * len(loaded)
    views: list[KVPoolSpec] = []
    allocators: list[BlockAllocator] = []
    kv_store: SharedTensorStore | None
    if len(loaded) == 1:
        blocks = num_blocks or num_blocks_for_budget(first_config, kv_cache_bytes, block_size, first_kv)
        views.append(KVPoolSpec.for_model(first_config, blocks, block_size, first_kv))
        kv_store = KVPool.create_shared(views[0], f"{shm_prefix}-kv", exist_ok=True).store
        allocators.append(BlockAllocator(blocks, block_size))
    elif kv_split == "static":
        share = pool_bytes // len(loaded) // 4096 * 4096  # each range page-aligned (and so dtype-aligned)
        for index, (spec, model_dir, config, kv) in enumerate(loaded):
            block_bytes = KVPoolSpec.for_model(config, 1, block_size, parse_dtype(kv)).bytes_per_block
            if share < block_bytes:
                raise ValueError(f"a KV share of {share} bytes holds no block of {block_bytes} bytes")
            views.append(KVPoolSpec.for_model(config, share // block_bytes, block_size, parse_dtype(kv), "block"))
            allocators.append(BlockAllocator(share // block_bytes, block_size))
            offsets[index] = index * share
        kv_store = KVPool.create_byte_pool(f"{shm_prefix}-kv", share * len(loaded), exist_ok=True)
    else:
        per_block = {name: KVPoolSpec.for_model(config, 1, block_size, parse_dtype(kv)).bytes_per_block
                     for (spec, model_dir, config, kv), name in zip(loaded, names, strict=True)}
        slabs = KVSlabPool(pool_bytes, per_block)
        kv_store = KVPool.create_byte_pool(f"{shm_prefix}-kv", slabs.num_slabs * slabs.slab_bytes, exist_ok=True)
        for (spec, model_dir, config, kv), name in zip(loaded, names, strict=True):
            slab_allocator = slabs.view(name, block_size)  # registered: carving evicts its cached blocks
            allocators.append(slab_allocator)
            views.append(KVPoolSpec.for_model(config, slab_allocator.num_blocks, block_size, parse_dtype(kv), "block"))
    assert kv_store is not None
    models: dict[str, ServedModel] = {}
    # Models of one checkpoint (the default pair: one model at two KV precisions) map one copy of
    # its weights: the store is the checkpoint's, whatever KV or format each model runs with.
    stores: dict[Path, SharedTensorStore] = {}
    for (spec, model_dir, config, kv), name, view, offset, allocator in zip(
            loaded, names, views, offsets, allocators, strict=True):
        store = stores.get(model_dir.resolve())
        if store is None:
            weights = load_checkpoint(model_dir, config, parse_dtype(dtype))
            part = "weights" if not stores else f"weights{len(stores)}"  # no "-": shm_files parts are one word
            store = stores[model_dir.resolve()] = share_weights(weights, f"{shm_prefix}-{part}", exist_ok=True)
            del weights
        else:
            log.info("%s maps the weights already loaded from %s (%s)", name, model_dir, store.name)
        fmt = effective_format(WeightFormat.parse(spec.quantization or quantization), parse_dtype(dtype))
        models[name] = ServedModel(name, model_dir, config, store, view, offset, dtype, kv, fmt,
                                   BlockLedger(allocator))
    if slabs is not None:  # each model's new prompts leave the slabs the others' preempted requests wait for
        for model in models.values():
            model.ledger.peers = [other.ledger for other in models.values() if other is not model]
    return Cell(models, kv_store, slabs)

