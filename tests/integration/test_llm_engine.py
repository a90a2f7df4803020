"""The single-process engine: continuous batching, preemption, aborts, prefix reuse, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.engine.errors import InvalidRequestError
from tandem.engine.llm import LLMEngine
from tandem.engine.sampling import SamplingParams
from tests.tiny_models import write_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", max_position_embeddings=96)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (5 + 3 * i,), generator=g).tolist() for i in range(n)]


def test_batched_equals_one_at_a_time(model_dir: Path) -> None:
    prompts = _prompts(6)
    batched = LLMEngine.from_dir(model_dir, num_blocks=64, block_size=4).generate(prompts, GREEDY)
    for prompt, result in zip(prompts, batched, strict=True):
        alone = LLMEngine.from_dir(model_dir, num_blocks=64, block_size=4).generate([prompt], GREEDY)[0]
        assert result.token_ids == alone.token_ids
        assert result.finish_reason == "length" and len(result.token_ids) == 12


def test_preemption_under_block_pressure_keeps_outputs_and_blocks(model_dir: Path) -> None:
    prompts = _prompts(6, seed=1)
    roomy = LLMEngine.from_dir(model_dir, num_blocks=64, block_size=4).generate(prompts, GREEDY)
    tight_engine = LLMEngine.from_dir(model_dir, num_blocks=14, block_size=4)
    tight = tight_engine.generate(prompts, GREEDY)
    assert [r.token_ids for r in tight] == [r.token_ids for r in roomy]
    assert tight_engine.num_preemptions > 0
    assert tight_engine.allocator.num_free_blocks == 14


def test_abort_mid_decode_returns_blocks(model_dir: Path) -> None:
    engine = LLMEngine.from_dir(model_dir, num_blocks=32, block_size=4)
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    rid_a = engine.add_request(_prompts(1)[0], long)
    rid_b = engine.add_request(_prompts(2)[1], long)
    rid_c = engine.add_request(list(range(3, 40)), long)
    engine.step()  # prefill
    for _ in range(3):
        engine.step()
    assert engine.allocator.num_free_blocks < 32
    engine.abort(rid_a)
    engine.abort(rid_b)
    engine.abort(rid_c)
    assert not engine.has_unfinished()
    assert engine.allocator.num_free_blocks == 32


def test_prefix_reuse_on_repeated_prompt(model_dir: Path) -> None:
    engine = LLMEngine.from_dir(model_dir, num_blocks=64, block_size=4)
    prompt = list(range(3, 30))
    first = engine.generate([prompt], GREEDY)[0]
    second = engine.generate([prompt], GREEDY)[0]
    assert first.num_cached_prompt_tokens == 0
    assert second.num_cached_prompt_tokens == 24  # 6 full blocks; the last token is recomputed
    assert second.token_ids == first.token_ids


def test_seeded_sampling_is_reproducible_across_batches(model_dir: Path) -> None:
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    prompt = _prompts(1, seed=3)[0]
    alone = LLMEngine.from_dir(model_dir, num_blocks=64, block_size=4).generate([prompt], seeded)[0]
    mixed = LLMEngine.from_dir(model_dir, num_blocks=64, block_size=4).generate(
        [_prompts(2, seed=4)[1], prompt], [SamplingParams(temperature=1.0, max_tokens=10), seeded]
    )[1]
    assert mixed.token_ids == alone.token_ids


def test_stops_at_eos_and_context_end(model_dir: Path) -> None:
    engine = LLMEngine.from_dir(model_dir, num_blocks=64, block_size=4)
    # Make every token an EOS: the first sampled token ends the request.
    engine.eos_token_ids = tuple(range(256))
    out = engine.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert out.finish_reason == "stop" and len(out.token_ids) == 1
    engine.eos_token_ids = ()
    near_end = list(range(3, 3 + 90))  # context is 96
    out = engine.generate([near_end], SamplingParams(temperature=0.0, max_tokens=50))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6


def test_bad_requests_are_refused_with_the_reason(model_dir: Path) -> None:
    engine = LLMEngine.from_dir(model_dir, num_blocks=16, block_size=4)
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(InvalidRequestError, match="context length is 96"):
        engine.add_request(list(range(96)), GREEDY)
    with pytest.raises(InvalidRequestError, match=r"\[0, 256\)"):
        engine.add_request([1, 999], GREEDY)
    with pytest.raises(InvalidRequestError, match="does not fit the KV pool"):
        engine.add_request(list(range(3, 80)), GREEDY)
    engine.add_request([1, 2], GREEDY, request_id="x")
    with pytest.raises(InvalidRequestError, match="'x' is already in use"):
        engine.add_request([1, 2], GREEDY, request_id="x")
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=-1.0)
