"""The cell's models (gpu_agent/models.py): --model entries, the pool each model views, and the
ledgers seen as one. Real shared-memory stores on /dev/shm, tiny random models."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_agent.blocks import BlockLedger
from gpu_agent.models import Cell, CellLedgers, build_cell
from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.errors import InvalidRequestError, OutOfBlocksError
from tandem.engine.kv_pool import KVPool
from tandem.engine.llm import LLMEngine
from tandem.engine.shm_files import remove_stores
from tandem.engine.weight_format import WeightFormat
from tandem.engine.weights import parse_dtype
from tandem.service.model_spec import ModelSpec, parse_models
from tests.tiny_models import write_tiny_model


def test_model_entries_parse_and_name_themselves(tmp_path: Path) -> None:
    assert parse_models("default") == (ModelSpec("default"),)
    a, b = parse_models("/m/x, /m/x:kv=bfloat16:quant=fp32")
    assert (b.path, b.kv_dtype, b.quantization) == ("/m/x", "bfloat16", "fp32")
    assert a.served_name(Path("/m/x")) == "x" and b.served_name(Path("/m/x")) == "x-kv-bfloat16-fp32"
    assert ModelSpec.parse("/m/x:name=small").served_name(Path("/m/x")) == "small"
    for bad in ("", ":kv=float16", "/m/x:kv=int3", "/m/x:colour=red", "/m/x:kv", "/m/x:kv=float16:kv=float32",
                "/m/x:quant=int3"):
        with pytest.raises(ValueError):
            parse_models(bad)


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return write_tiny_model(tmp_path / "tiny", "llama")


@pytest.fixture
def prefix() -> Iterator[str]:
    name = f"cm-{uuid.uuid4().hex[:8]}"
    yield name
    remove_stores(name)


def _cell(tiny: Path, prefix: str, entries: str, split: str = "slab", kv_bytes: int = 1 << 20) -> Cell:
    return build_cell(parse_models(entries.format(m=tiny)), dtype="float32", kv_dtype="", quantization="fp32",
                      block_size=4, kv_cache_bytes=kv_bytes, num_blocks=0, shm_prefix=prefix, kv_split=split)


def test_one_model_keeps_its_layer_major_pool(tiny: Path, prefix: str) -> None:
    cell = _cell(tiny, prefix, "{m}")
    (model,) = cell.models.values()
    assert cell.slabs is None and model.kv.layout == "layer" and model.kv_offset == 0
    assert type(model.ledger.allocator) is BlockAllocator and model.name == "tiny"
    assert KVPool.view_of(model.kv, cell.kv_store).tensor.shape == model.kv.shape
    assert cell.model("") is model and cell.model("tiny") is model
    with pytest.raises(InvalidRequestError, match="serves no model 'x'"):
        cell.model("x")


@pytest.mark.parametrize(("quantization", "dtype", "flag", "entry", "expected"), [
    ("ggml", "float32", "", "{m}", torch.float16),  # llama.cpp's own cache for its formats
    ("ggml", "bfloat16", "", "{m}", torch.bfloat16),  # the weights' dtype where it is not fp32
    ("fp32", "float32", "", "{m}:quant=ggml", torch.float16),  # the model's own format decides
    ("ggml", "float32", "", "{m}:quant=fp16", torch.float32),
    ("ggml", "float32", "float32", "{m}", torch.float32),  # asked for: as asked
    ("ggml", "float32", "", "{m}:kv=bfloat16", torch.bfloat16),
    ("fp32", "float32", "", "{m}", torch.float32),
    ("fp16", "float32", "bfloat16", "{m}", torch.bfloat16),
])
def test_the_kv_pool_defaults_to_fp16_for_ggml_formats_and_to_the_weights_dtype_else(
        tiny: Path, prefix: str, quantization: str, dtype: str, flag: str, entry: str, expected: torch.dtype) -> None:
    (spec,) = parse_models(entry.format(m=tiny))
    cell = build_cell((spec,), dtype=dtype, kv_dtype=flag, quantization=quantization,
                      block_size=4, kv_cache_bytes=1 << 20, num_blocks=0, shm_prefix=prefix)
    (model,) = cell.models.values()
    assert model.kv.dtype == expected and model.kv_dtype == str(expected).removeprefix("torch.")
    assert KVPool.view_of(model.kv, cell.kv_store).tensor.dtype == expected
    # The in-process engine of the same format and dtype holds the same pool (mesh = engine).
    if not spec.kv_dtype:
        engine = LLMEngine.from_dir(tiny, dtype=parse_dtype(dtype), num_blocks=8,
                                    weight_format=WeightFormat.parse(spec.quantization or quantization),
                                    kv_dtype=parse_dtype(flag) if flag else None)
        assert engine.runner.pool.spec.dtype == expected


def test_two_models_share_slabs_and_one_byte_pool(tiny: Path, prefix: str) -> None:
    cell = _cell(tiny, prefix, "{m},{m}:kv=bfloat16")
    a, b = cell.models.values()
    assert cell.slabs is not None and a.kv.layout == b.kv.layout == "block"
    assert a.kv.bytes_per_block == 2 * b.kv.bytes_per_block  # fp32 vs bf16 K/V
    assert a.kv.num_bytes == b.kv.num_bytes == cell.slabs.num_slabs * cell.slabs.slab_bytes
    assert cell.kv_store.tensors["kv"].numel() == a.kv.num_bytes
    # A slab given to one model is no longer free to the other.
    got = a.ledger.allocate("r1", list(range(9)), owner="s1")
    assert cell.slabs.num_free_slabs == cell.slabs.num_slabs - -(-len(got.block_ids) // cell.slabs.blocks_per_slab(
        a.name))
    assert b.ledger.allocator.num_free_blocks == cell.slabs.num_free_slabs * cell.slabs.blocks_per_slab(b.name)
    a.ledger.release("r1", list(range(9)))  # published: its slabs keep a's cached blocks
    assert cell.slabs.num_free_slabs == cell.slabs.num_slabs
    assert list(a.ledger.peers) == [b.ledger] and list(b.ledger.peers) == [a.ledger]  # holds count across models


@pytest.mark.parametrize("split", ["slab", "static"])
def test_models_of_one_checkpoint_map_one_copy_of_its_weights(tiny: Path, tmp_path: Path, prefix: str,
                                                              split: str) -> None:
    """The same checkpoint at two KV precisions (and a format of its own) is one weight store in
    shared memory, holding that checkpoint's tensors; another checkpoint gets a store of its own."""
    other = write_tiny_model(tmp_path / "other", "llama", seed=1)
    cell = _cell(tiny, prefix, "{m},{m}:kv=bfloat16:quant=fp32-packed," + str(other), split=split)
    a, b, c = cell.models.values()
    assert a.weights is not None and b.weights is not None and c.weights is not None
    assert a.weights is b.weights and a.weights.name == b.weights.name != c.weights.name
    assert a.kv_dtype != b.kv_dtype and a.weight_format != b.weight_format
    files = sorted(p.name for p in Path("/dev/shm").glob(f"*{prefix}-weights*"))
    assert len(files) == 2 * len({a.weights.name, c.weights.name}), files  # data and index of each store
    mine, theirs = dict(a.weights.tensors), dict(c.weights.tensors)
    assert mine.keys() == theirs.keys()
    assert any(not torch.equal(mine[k], theirs[k]) for k in mine)  # c's are its own checkpoint's


def test_every_slab_goes_from_one_model_to_the_other_and_back(tiny: Path, prefix: str) -> None:
    """Slabs freed by one model (its blocks cached in them) are carved for the other, repeatedly."""
    cell = _cell(tiny, prefix, "{m},{m}:kv=bfloat16", kv_bytes=1 << 18)
    assert cell.slabs is not None
    a, b = cell.models.values()
    for round_ in range(3):
        for model in (a, b):
            tokens = model.ledger.allocator.num_free_blocks * 4  # the whole pool, in this model's blocks
            ids = [round_ * 7 + i for i in range(tokens)]
            got = model.ledger.allocate(f"{model.name}-{round_}", ids, owner="s")
            assert cell.slabs.num_free_slabs == 0 and len(got.block_ids) == cell.slabs.num_slabs * (
                cell.slabs.blocks_per_slab(model.name))
            model.ledger.release(f"{model.name}-{round_}", ids)
            cell.slabs.check()
    assert cell.slabs.num_free_slabs == cell.slabs.num_slabs


def test_a_static_split_gives_each_model_its_own_byte_range(tiny: Path, prefix: str) -> None:
    cell = _cell(tiny, prefix, "{m},{m}:kv=bfloat16", split="static", kv_bytes=(3 << 18) + 4097)  # odd: aligned
    a, b = cell.models.values()
    assert cell.slabs is None and (a.kv_offset, b.kv_offset) == (0, 3 << 17)
    assert a.kv.num_bytes <= b.kv_offset and b.kv_offset + b.kv.num_bytes <= cell.kv_store.tensors["kv"].numel()
    assert not a.ledger.peers and not b.ledger.peers  # separate pools: one model's holds are not the other's
    assert b.kv.num_blocks == 2 * a.kv.num_blocks  # the same bytes, blocks half the size
    view_a, view_b = KVPool.view_of(a.kv, cell.kv_store, a.kv_offset), KVPool.view_of(b.kv, cell.kv_store,
                                                                                    b.kv_offset)
    view_b.tensor.fill_(1)
    assert view_a.tensor.abs().sum() == 0  # b's range is not a's
    view_a.tensor.fill_(2)
    assert bool((view_b.tensor == 1).all())
    with pytest.raises(ValueError, match="two --model entries serve the name"):
        _cell(tiny, prefix + "x", "{m},{m}")


@pytest.mark.parametrize("split", ["slab", "static"])
def test_each_models_share_of_the_pool_is_its_held_bytes(tiny: Path, prefix: str, split: str) -> None:
    """The agent's per-model KV use (the router's kv_cache_usage_perc{model_name}): held blocks'
    bytes over the cell's pool bytes; a model holding every slab holds the whole pool."""
    cell = _cell(tiny, prefix, "{m},{m}:kv=bfloat16", split=split, kv_bytes=1 << 18)
    a, b = cell.models.values()
    assert cell.kv_used_by_model() == {a.name: 0.0, b.name: 0.0}
    rng = random.Random(split)
    held: dict[str, list[tuple[str, list[int]]]] = {a.name: [], b.name: []}
    for step in range(40):
        model = rng.choice([a, b])
        if held[model.name] and rng.random() < 0.4:
            rid, ids = held[model.name].pop(rng.randrange(len(held[model.name])))
            model.ledger.release(rid, ids)
        else:
            ids = [step * 100 + i for i in range(rng.randint(1, 20))]
            try:
                model.ledger.allocate(f"r{step}", ids, owner="s")
            except OutOfBlocksError:  # the pool is full: nothing held changes
                pass
            else:
                held[model.name].append((f"r{step}", ids))
        used = cell.kv_used_by_model()
        for m in (a, b):
            assert used[m.name] == m.ledger.allocator.num_used_blocks * m.kv.bytes_per_block / cell.kv_bytes
        assert 0 <= sum(used.values()) <= 1
        # The policy's view: the pool's free share, in the first model's blocks.
        free, total = cell.kv_blocks_free()
        assert total == a.ledger.allocator.num_blocks
        assert abs(free - (1 - sum(used.values())) * total) <= 0.5
    for m in (a, b):
        for rid, ids in held[m.name]:
            m.ledger.release(rid, ids)
    if split == "slab":
        tokens = a.ledger.allocator.num_free_blocks * 4
        a.ledger.allocate("all", list(range(10**6, 10**6 + tokens)), owner="s")
        assert cell.kv_used_by_model()[a.name] == 1.0


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.sampled_from(["s1", "s2", "s3"]), st.integers(1, 12)),
                min_size=1, max_size=12))
def test_the_ledgers_seen_as_one_reclaim_each_owner_exactly_once(jobs: list[tuple[str, str, int]]) -> None:
    ledgers = {"a": BlockLedger(BlockAllocator(64, 4)), "b": BlockLedger(BlockAllocator(64, 4))}
    cell = CellLedgers(ledgers)
    held: dict[str, list[str]] = {}
    for i, (model, owner, tokens) in enumerate(jobs):
        ledgers[model].allocate(f"r{i}", list(range(tokens)), owner=owner)
        held.setdefault(owner, []).append(f"r{i}")
        assert cell.of_request(f"r{i}") is ledgers[model]
    assert cell.num_requests == len(jobs)
    for owner, rids in held.items():
        assert sorted(cell.owned_by(owner)) == sorted(rids)
        assert cell.reclaim(owner)[0] == len(rids)
        assert cell.reclaim(owner) == (0, 0)
    assert all(ledger.allocator.num_free_blocks == 64 for ledger in ledgers.values())
