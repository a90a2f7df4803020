"""The router's per-request text state (``router.core.Generation``) with SmolLM2's real tokenizer:
vLLM's ``include_stop_str_in_output`` and ``skip_special_tokens`` over tokens that arrive in
updates of random sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.core import Generation
from tandem.engine.sampling import SamplingParams
from tandem.engine.tokenizer import Tokenizer
from tandem.rpc.v1 import common_pb2

TEXT = ("The quick brown fox jumps over the lazy dog. Über café, naïve 東京 and emoji 🙂 end the line.\n"
        "A second line follows with numbers 12345 and symbols #@!.")
UNSET = common_pb2.FINISH_REASON_UNSPECIFIED


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


def _run(generation: Generation, ids: list[int], cuts: list[int]) -> tuple[str, int]:
    """Feed ``ids`` in updates split at ``cuts``; the text and the finish reason."""
    text, bounds = [], sorted({0, *(c for c in cuts if 0 < c < len(ids)), len(ids)})
    for start, end in zip(bounds, bounds[1:]):
        last = end == len(ids)
        tokens = [common_pb2.GeneratedToken(token_id=i) for i in ids[start:end]]
        response = generation.advance(start, tokens, common_pb2.FINISH_REASON_LENGTH if last else UNSET)
        if response is not None:
            text.append(response.text)
        if generation.finished:
            break
    return "".join(text), generation.finish_reason


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), include=st.booleans())
def test_the_stop_string_ends_the_text_when_asked(smollm2: Tokenizer, data: st.DataObject, include: bool) -> None:
    ids = smollm2.encode(TEXT, add_special_tokens=False)
    start = data.draw(st.integers(0, len(TEXT) - 2))
    stop = TEXT[start:start + data.draw(st.integers(1, 8))]
    cuts = data.draw(st.lists(st.integers(1, len(ids) - 1), max_size=8))
    generation = Generation("r", smollm2, [1, 2], SamplingParams(max_tokens=len(ids)), [stop], include_stop_str=include)
    text, finish = _run(generation, ids, cuts)
    end = TEXT.index(stop)
    assert text == (TEXT[:end + len(stop)] if include else TEXT[:end])
    assert finish == common_pb2.FINISH_REASON_STOP


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_special_tokens_are_in_the_text_only_when_not_skipped(smollm2: Tokenizer, data: st.DataObject,
                                                              skip: bool) -> None:
    words = data.draw(st.lists(st.sampled_from(["Hello", " world", "<|im_end|>", "\n", "<|im_start|>", "é"]),
                               min_size=1, max_size=10))
    ids = [i for word in words for i in smollm2.encode(word, add_special_tokens=False)]
    cuts = data.draw(st.lists(st.integers(1, max(1, len(ids) - 1)), max_size=4))
    generation = Generation("r", smollm2, [1], SamplingParams(max_tokens=len(ids)), [], skip_special_tokens=skip)
    text, finish = _run(generation, ids, cuts)
    assert text == smollm2.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in text) == ("<|im_end|>" in words and not skip)
    assert finish == common_pb2.FINISH_REASON_LENGTH
