"""Engine logits against Hugging Face transformers on tiny random checkpoints of each family.

Every execution path must give the reference logits: whole prefill, layer-group prefill,
chunked prefill, prefix reuse, step-by-step decode and mixed (hybrid) batches.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.config import ModelConfig
from tandem.engine.kv_pool import KVPool, KVPoolSpec
from tandem.engine.quant import WeightFormat
from tandem.engine.runner import ModelRunner, SeqInput
from tests.tiny_models import TINY_FAMILIES, write_tiny_model

ATOL = 2e-4
BLOCK_SIZE = 4


@pytest.fixture(scope="module",
                params=[(f, fmt) for f in sorted(TINY_FAMILIES) for fmt in (WeightFormat.FP32, WeightFormat.FP32_PACKED)],
                ids=lambda p: f"{p[0]}-{p[1].value}")
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, WeightFormat]:
    """A tiny checkpoint, its transformers reference, and the fp32 weight format our runner uses
    (the reduced formats have their own tolerances: tests/integration/test_quant.py)."""
    import transformers

    family, fmt = request.param
    model_dir = write_tiny_model(tmp_path_factory.mktemp(family), family)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model_dir, hf, fmt


def _runner(tiny: tuple[Path, object, WeightFormat], num_blocks: int = 64) -> tuple[ModelRunner, BlockAllocator]:
    model_dir, _, fmt = tiny
    config = ModelConfig.from_dir(model_dir)
    pool = KVPool.create(KVPoolSpec.for_model(config, num_blocks, BLOCK_SIZE))
    runner = ModelRunner.from_dir(model_dir, pool, weight_format=fmt)
    assert runner.model.weight_format == fmt
    return runner, BlockAllocator(num_blocks, BLOCK_SIZE)


def _reference(hf: object, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]  # type: ignore[operator, no-any-return]


def _prompt(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (length,), generator=g).tolist()


def test_whole_and_layer_group_prefill(tiny: tuple[Path, object, WeightFormat]) -> None:
    _, hf, _ = tiny
    runner, alloc = _runner(tiny)
    ids = _prompt(1, 37)
    ref = _reference(hf, ids)
    blocks = alloc.allocate(ids).block_ids
    whole = runner.forward([SeqInput(ids, 0, blocks)])
    torch.testing.assert_close(whole[0], ref[-1], atol=ATOL, rtol=0)

    state = runner.begin([SeqInput(ids, 0, blocks)])
    for end in range(1, runner.num_layers + 1):
        runner.run_layers(state, end)  # one layer per group
    torch.testing.assert_close(runner.finish(state)[0], ref[-1], atol=ATOL, rtol=0)


def test_chunked_prefill_matches_every_chunk_end(tiny: tuple[Path, object, WeightFormat]) -> None:
    _, hf, _ = tiny
    runner, alloc = _runner(tiny)
    ids = _prompt(2, 30)
    ref = _reference(hf, ids)
    blocks = alloc.allocate(ids).block_ids
    for start in range(0, 30, 7):
        chunk = ids[start : start + 7]
        logits = runner.forward([SeqInput(chunk, start, blocks)])
        torch.testing.assert_close(logits[0], ref[start + len(chunk) - 1], atol=ATOL, rtol=0)


def test_prefix_reuse_computes_only_new_tokens(tiny: tuple[Path, object, WeightFormat]) -> None:
    _, hf, _ = tiny
    runner, alloc = _runner(tiny)
    first = _prompt(3, 21)
    a = alloc.allocate(first)
    runner.forward([SeqInput(first, 0, a.block_ids)])
    alloc.publish(a.block_ids, first)

    second = first[:16] + _prompt(4, 9)
    b = alloc.allocate(second)
    assert b.num_cached_tokens == 16 and b.block_ids[:4] == a.block_ids[:4]
    logits = runner.forward([SeqInput(second[16:], 16, b.block_ids)])
    torch.testing.assert_close(logits[0], _reference(hf, second)[-1], atol=ATOL, rtol=0)


def test_step_by_step_decode(tiny: tuple[Path, object, WeightFormat]) -> None:
    _, hf, _ = tiny
    runner, alloc = _runner(tiny)
    ids = _prompt(5, 26)
    ref = _reference(hf, ids)
    blocks = list(alloc.allocate(ids[:10]).block_ids)
    runner.forward([SeqInput(ids[:10], 0, blocks)])
    for pos in range(10, 26):
        blocks += alloc.extend(blocks, pos + 1)
        logits = runner.decode([ids[pos]], [pos + 1], [blocks])
        torch.testing.assert_close(logits[0], ref[pos], atol=ATOL, rtol=0)


def test_hybrid_batch_of_prefills_chunks_and_decodes(tiny: tuple[Path, object, WeightFormat]) -> None:
    """One forward with a fresh prompt, a middle chunk and two decode tokens of other lengths."""
    _, hf, _ = tiny
    runner, alloc = _runner(tiny)
    fresh, chunked, dec_a, dec_b = _prompt(6, 13), _prompt(7, 24), _prompt(8, 19), _prompt(9, 6)
    tables = {}
    for name, ids, done in (("chunked", chunked, 8), ("a", dec_a, 18), ("b", dec_b, 5)):
        tables[name] = alloc.allocate(ids).block_ids
        runner.forward([SeqInput(ids[:done], 0, tables[name])])
    fresh_blocks = alloc.allocate(fresh).block_ids
    batch = [
        SeqInput(dec_a[18:], 18, tables["a"]),
        SeqInput(fresh, 0, fresh_blocks),
        SeqInput(chunked[8:20], 8, tables["chunked"]),
        SeqInput(dec_b[5:], 5, tables["b"]),
    ]
    logits = runner.forward(batch)
    expected = [_reference(hf, dec_a)[-1], _reference(hf, fresh)[-1],
                _reference(hf, chunked)[19], _reference(hf, dec_b)[-1]]
    for got, want in zip(logits, expected, strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("seed", range(6))
def test_decode_batch_of_mixed_lengths_in_any_order(tiny: tuple[Path, object, WeightFormat], seed: int) -> None:
    """A decode batch of random contexts (so several length groups) in a random order, plus a
    prompt row on some seeds: each row's logits equal the reference for its own sequence."""
    _, hf, _ = tiny
    runner, alloc = _runner(tiny, num_blocks=256)
    g = torch.Generator().manual_seed(seed)
    low, high = (2, 60) if seed < 2 else (40, 47)  # spread out (several groups) or close (one group)
    lengths = torch.randint(low, high, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
    batch, expected = [], []
    for i, n in enumerate(lengths):
        ids = _prompt(100 * seed + i, n)
        blocks = alloc.allocate(ids).block_ids
        runner.forward([SeqInput(ids[:-1], 0, blocks)])
        batch.append(SeqInput(ids[-1:], n - 1, blocks))
        expected.append(_reference(hf, ids)[-1])
    if seed % 3 == 1:
        fresh = _prompt(1000 + seed, 7)
        batch.append(SeqInput(fresh, 0, alloc.allocate(fresh).block_ids))
        expected.append(_reference(hf, fresh)[-1])
    order = torch.randperm(len(batch), generator=g).tolist()
    logits = runner.forward([batch[i] for i in order])
    for row, i in enumerate(order):
        torch.testing.assert_close(logits[row], expected[i], atol=ATOL, rtol=0)


@pytest.mark.parametrize("table", [[3, 4, 5, 6, 7], [9, 2, 14, 0, 6]], ids=["run", "scattered"])
def test_lone_decode_row_over_consecutive_or_scattered_blocks(
    tiny: tuple[Path, object, WeightFormat], table: list[int]
) -> None:
    _, hf, _ = tiny
    runner, _ = _runner(tiny)
    ids = _prompt(21, 19)
    runner.forward([SeqInput(ids[:-1], 0, table)])
    logits = runner.forward([SeqInput(ids[-1:], 18, table)])
    torch.testing.assert_close(logits[0], _reference(hf, ids)[-1], atol=ATOL, rtol=0)


def test_chunk_without_logits_is_skipped_in_output(tiny: tuple[Path, object, WeightFormat]) -> None:
    runner, alloc = _runner(tiny)
    ids = _prompt(10, 12)
    blocks = alloc.allocate(ids).block_ids
    out = runner.forward([SeqInput(ids[:6], 0, blocks, need_logits=False), SeqInput(_prompt(11, 3), 0, alloc.allocate([1, 2, 3]).block_ids)])
    assert out.shape == (1, runner.config.vocab_size)


def test_bf16_runs_close_to_fp32(tmp_path: Path) -> None:
    model_dir = write_tiny_model(tmp_path, "llama")
    config = ModelConfig.from_dir(model_dir)
    ids = _prompt(12, 20)
    outs = []
    for dtype in (torch.float32, torch.bfloat16):
        pool = KVPool.create(KVPoolSpec.for_model(config, 16, BLOCK_SIZE, dtype))
        runner = ModelRunner.from_dir(model_dir, pool, dtype=dtype)
        outs.append(runner.forward([SeqInput(ids, 0, list(range(5)))])[0])
    assert outs[1].dtype == torch.float32  # logits are always returned in fp32
    assert (outs[0] - outs[1]).abs().max() < 0.1
    assert int(outs[0].argmax()) == int(outs[1].argmax())


def test_sharded_checkpoint_with_index_loads(tmp_path: Path) -> None:
    """A checkpoint split into shards with model.safetensors.index.json gives the same logits."""
    import transformers

    model_dir = write_tiny_model(tmp_path / "whole", "qwen2")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    config = ModelConfig.from_dir(sharded)
    ids = _prompt(13, 9)
    outs = []
    for d in (model_dir, sharded):
        runner = ModelRunner.from_dir(d, KVPool.create(KVPoolSpec.for_model(config, 8, BLOCK_SIZE)))
        outs.append(runner.forward([SeqInput(ids, 0, [0, 1, 2])])[0])
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
