"""The real default model (SmolLM2-135M-Instruct, imported from its GGUF) against transformers.

transformers loads the same imported directory and is the reference for logits and for
greedy generation; every engine path must agree with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.config import ModelConfig
from tandem.engine.kv_pool import KVPool, KVPoolSpec
from tandem.engine.llm import LLMEngine
from tandem.engine.quant import WeightFormat
from tandem.engine.runner import ModelRunner, SeqInput
from tandem.engine.sampling import SamplingParams
from tandem.engine.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why do cats purr?"}],
    [{"role": "user", "content": "Write a haiku about autumn rain."}],
]
LOGIT_ATOL = 2e-3  # fp32, 30 layers: summation order differs from transformers' kernels


@pytest.fixture(scope="module")
def hf_model(smollm2_dir: Path) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


@pytest.fixture(scope="module")
def runner(smollm2_dir: Path) -> ModelRunner:
    config = ModelConfig.from_dir(smollm2_dir)
    return ModelRunner.from_dir(smollm2_dir, KVPool.create(KVPoolSpec.for_model(config, 96, 16)), 
                                weight_format=WeightFormat.FP32_PACKED)


def test_all_paths_match_reference_logits(runner: ModelRunner, hf_model: Any, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode_chat(CHATS[1])
    n = len(ids)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0]
    alloc = BlockAllocator(96, 16)

    def fresh() -> list[int]:
        return list(alloc.allocate(ids).block_ids)

    whole = runner.forward([SeqInput(ids, 0, fresh())])[0]
    torch.testing.assert_close(whole, ref[-1], atol=LOGIT_ATOL, rtol=0)

    state = runner.begin([SeqInput(ids, 0, fresh())])
    for end in (7, 8, 20, 30):  # uneven layer groups
        runner.run_layers(state, end)
    torch.testing.assert_close(runner.finish(state)[0], ref[-1], atol=LOGIT_ATOL, rtol=0)

    blocks = fresh()
    for start in range(0, n, 13):
        chunk = ids[start : start + 13]
        out = runner.forward([SeqInput(chunk, start, blocks)])[0]
        torch.testing.assert_close(out, ref[start + len(chunk) - 1], atol=LOGIT_ATOL, rtol=0)

    first = alloc.allocate(ids)
    runner.forward([SeqInput(ids, 0, first.block_ids)])
    alloc.publish(first.block_ids, ids)
    reuse = alloc.allocate(ids)
    assert reuse.num_cached_tokens == (n - 1) // 16 * 16 > 0
    out = runner.forward([SeqInput(ids[reuse.num_cached_tokens :], reuse.num_cached_tokens, reuse.block_ids)])[0]
    torch.testing.assert_close(out, ref[-1], atol=LOGIT_ATOL, rtol=0)

    blocks = list(alloc.allocate(ids[:12]).block_ids)
    runner.forward([SeqInput(ids[:12], 0, blocks)])
    for pos in range(12, n):
        blocks += alloc.extend(blocks, pos + 1)
        out = runner.decode([ids[pos]], [pos + 1], [blocks])[0]
        torch.testing.assert_close(out, ref[pos], atol=LOGIT_ATOL, rtol=0)


def test_greedy_generation_equals_transformers(smollm2_dir: Path, hf_model: Any, tokenizer: Tokenizer) -> None:
    """32 greedy tokens for each of three chats, all three batched together in our engine."""
    engine = LLMEngine.from_dir(smollm2_dir, num_blocks=64, weight_format=WeightFormat.FP32_PACKED)
    prompts = [tokenizer.encode_chat(chat) for chat in CHATS]
    # min_tokens masks EOS as transformers' min_new_tokens does, so both run 32 tokens.
    params = SamplingParams(temperature=0.0, max_tokens=32, min_tokens=32)
    ours = engine.generate(prompts, params)
    for prompt, completion in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ref = hf_model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=2,
            )[0, len(prompt):].tolist()
        assert completion.token_ids == ref, tokenizer.decode(ref)
    assert "Paris" in tokenizer.decode(ours[0].token_ids)
    assert engine.allocator.num_free_blocks == 64
