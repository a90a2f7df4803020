"""decode_svc's start-up timing of prompt steps (``warm_up``'s ``time_prompts``), which anchors the
agent's predictor of a hybrid step's prompt part."""

from __future__ import annotations

import random

import pytest

from tandem.engine.attention import make_backend
from tandem.engine.model import LlamaModel
from tandem.engine.random_weights import random_weights, tiny_config
from tandem.engine.runner import warm_up


@pytest.mark.parametrize("seed", range(3))
def test_each_size_is_timed_beside_one_decoding_sequence(seed: int) -> None:
    rng = random.Random(seed)
    config = tiny_config()
    model = LlamaModel(config, random_weights(config, seed=seed), make_backend("torch", config.num_heads))
    sizes = sorted(rng.sample(range(1, 300), rng.randint(1, 3)))
    context = rng.randint(1, 200)
    timings = warm_up(model, prompt_tokens=context, decode_batches=(1, rng.randint(1, 4)),
                      time_prompts=[*sizes, config.max_position_embeddings, 0], repeats=1)
    # sizes the model cannot take (past its positions, or none) are left out
    assert [t.prompt_tokens for t in timings] == sizes
    for t in timings:
        assert t.decode_context_lens == (context + 1,)
        assert t.prompt_s > 0 and t.decode_s > 0
        assert t.decode_s == timings[0].decode_s  # one decode step, timed once
    assert warm_up(model, time_prompts=[]) == []
