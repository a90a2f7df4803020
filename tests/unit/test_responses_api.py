"""OpenAI's Responses API (router.responses): a body becomes the chat request it means, what is
not implemented is refused naming the parameter, and the answer is read by the `openai` client's
own types. The stream's events run on the real stack (tests/e2e/test_openai_api.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.responses import Response

from router.choices import ChoiceState, absorb
from router.http import HTTPError, parse_request, parse_responses_request
from router.responses import ResponsesRenderer
from tandem.engine.tokenizer import Tokenizer
from tandem.protocol import MAX_MESSAGES, SamplingDefaults
from tandem.rpc.v1 import common_pb2, router_pb2

CONTEXT = 2048
ROLES = ["user", "assistant", "system", "developer"]

texts = st.text(st.characters(codec="utf-8"), max_size=12)
parts = st.lists(st.builds(lambda kind, text: {"type": kind, "text": text},
                           st.sampled_from(["input_text", "output_text"]), texts), min_size=1, max_size=3)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": texts | parts},
                                          optional={"type": st.just("message")}), min_size=1, max_size=4)


def _text(content: str | list[dict[str, str]]) -> str:
    return content if isinstance(content, str) else "".join(part["text"] for part in content)


@settings(max_examples=60, deadline=None)
@given(input=texts | messages, instructions=st.none() | texts, max_output_tokens=st.none() | st.integers(1, CONTEXT),
       temperature=st.none() | st.floats(0, 2), seed=st.none() | st.integers(0, 1000), stream=st.booleans())
def test_a_response_is_the_chat_request_it_means(input: Any, instructions: str | None, max_output_tokens: int | None,
                                                 temperature: float | None, seed: int | None, stream: bool) -> None:
    body: dict[str, Any] = {"model": "m", "input": input, "stream": stream}
    for name, value in (("instructions", instructions), ("max_output_tokens", max_output_tokens),
                        ("temperature", temperature), ("seed", seed)):
        if value is not None:
            body[name] = value
    asked, parsed = parse_responses_request(body, CONTEXT, "resp_1")
    want = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(input, str):
        want.append({"role": "user", "content": input})
    else:
        want.extend({"role": "system" if m["role"] == "developer" else m["role"], "content": _text(m["content"])}
                    for m in input)
    chat = {"model": "m", "messages": want, "stream": stream, **({"seed": seed} if seed is not None else {})}
    if max_output_tokens is not None:
        chat["max_tokens"] = max_output_tokens
    if temperature is not None:
        chat["temperature"] = temperature
    # the same requests the chat endpoint makes of that body
    assert [r.SerializeToString(deterministic=True) for r in parsed.requests] == [
        r.SerializeToString(deterministic=True) for r in parse_request("chat", chat, CONTEXT, "resp_1").requests]
    assert parsed.stream is stream and len(parsed.requests) == 1
    assert asked.max_output_tokens == max_output_tokens


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "grammar"}}}, "text"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"background": True}, "background"),
    ({"top_logprobs": 21, "include": ["message.output_text.logprobs"]}, "top_logprobs"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"max_output_tokens": CONTEXT + 1}, "max_output_tokens"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"top_k": -5}, "top_k"),
    ({"input": [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)}, "input"),
    ({"instructions": "be brief", "input": [{"role": "user", "content": "hi"}] * MAX_MESSAGES}, "input"),
])
def test_what_is_not_implemented_or_invalid_is_refused_naming_it(body: dict[str, Any], param: str) -> None:
    with pytest.raises(HTTPError) as info:
        parse_responses_request({"input": "hi", **body}, CONTEXT, "resp_1")
    assert info.value.status == 400 and info.value.param == param, info.value.message


@pytest.mark.parametrize("body", [
    {"tools": []}, {"tools": [{"type": "function", "name": "f"}], "tool_choice": "none"}, {"tool_choice": "auto"},
    {"text": {"format": {"type": "text"}}}, {"top_logprobs": 3}, {"background": False}, {"store": True},
    {"include": ["reasoning.encrypted_content"]}, {"truncation": "auto"}, {"reasoning": {"effort": "low"}},
    {"metadata": {"k": "v"}}, {"user": "u", "parallel_tool_calls": False, "service_tier": "auto"},
])
def test_values_that_ask_for_nothing_are_accepted(body: dict[str, Any]) -> None:
    asked, parsed = parse_responses_request({"input": "hi", **body}, CONTEXT, "resp_1")
    assert len(parsed.requests) == 1


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


@pytest.mark.parametrize("include, top, want", [
    (None, None, None), (["message.output_text.logprobs"], None, 0), (["message.output_text.logprobs"], 5, 5),
    (["reasoning.encrypted_content"], 5, None),  # alternatives without the logprobs: none asked for
])
def test_logprobs_only_when_included(include: list[str] | None, top: int | None, want: int | None) -> None:
    body: dict[str, Any] = {"input": "hi", "include": include, "top_logprobs": top}
    _, parsed = parse_responses_request(body, CONTEXT, "resp_1")
    sampling = parsed.requests[0].sampling
    assert parsed.num_logprobs == want
    assert (sampling.logprobs if sampling.HasField("logprobs") else None) == want


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(texts, min_size=1, max_size=6), finish=st.sampled_from(["stop", "length", "abort"]),
       prompt=st.integers(1, 500), cached=st.integers(0, 500), metadata=st.dictionaries(texts, texts, max_size=3),
       instructions=st.none() | texts, max_output_tokens=st.none() | st.integers(1, 64),
       top=st.none() | st.integers(0, 3), ids=st.lists(st.integers(0, 49151), min_size=6, max_size=6))
def test_the_response_object_reads_as_the_openai_clients(smollm2: Tokenizer, pieces: list[str], finish: str,
                                                         prompt: int, cached: int, metadata: dict[str, str],
                                                         instructions: str | None, max_output_tokens: int | None,
                                                         top: int | None, ids: list[int]) -> None:
    body: dict[str, Any] = {"input": "hi", "metadata": metadata, "instructions": instructions}
    if max_output_tokens is not None:
        body["max_output_tokens"] = max_output_tokens
    if top is not None:  # logprobs with top alternatives
        body.update(include=["message.output_text.logprobs"], top_logprobs=top)
    defaults = SamplingDefaults(temperature=0.2, top_p=0.9)
    asked, parsed = parse_responses_request(body, CONTEXT, "resp_1", defaults)
    renderer = ResponsesRenderer("SmolLM2", smollm2, asked, parsed, "resp_1", defaults)
    state = ChoiceState()
    reason = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
              "abort": common_pb2.FINISH_REASON_ABORT}[finish]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        token = common_pb2.GeneratedToken(token_id=ids[i], logprob=-0.5 * i)
        token.top_logprobs.extend(common_pb2.TopLogprob(token_id=ids[-1 - j], logprob=-1.0 - j)
                                  for j in range(top or 0))
        response = router_pb2.GenerateResponse(request_id="resp_1-0", text=piece, tokens=[token],
                                               finish_reason=reason if last else common_pb2.FINISH_REASON_UNSPECIFIED)
        if last:
            response.usage.CopyFrom(router_pb2.Usage(prompt_tokens=prompt, completion_tokens=len(pieces),
                                                     cached_tokens=min(cached, prompt)))
        absorb(state, response)
    whole = json.loads(json.dumps(renderer.response(state)))
    read = Response.model_validate(whole)  # the client's own type, validated
    assert read.output_text == "".join(pieces)
    assert read.status == ("completed" if finish == "stop" else "incomplete")
    assert (read.incomplete_details is not None) == (finish == "length")
    assert read.usage is not None and read.usage.input_tokens == prompt
    assert read.usage.output_tokens == len(pieces) and read.usage.total_tokens == prompt + len(pieces)
    assert read.usage.input_tokens_details.cached_tokens == min(cached, prompt)
    assert read.metadata == metadata and read.instructions == instructions
    assert read.max_output_tokens == max_output_tokens
    assert read.temperature == pytest.approx(0.2) and read.top_p == pytest.approx(0.9)
    assert read.model == "SmolLM2" and read.id == "resp_1" and read.tools == [] and read.error is None
    message = read.output[0]
    assert message.type == "message"
    [text] = message.content
    assert text.type == "output_text"
    if top is None:
        assert text.logprobs is None
    else:
        logprobs = text.logprobs
        assert logprobs is not None and [lp.logprob for lp in logprobs] == [-0.5 * i for i in range(len(pieces))]
        assert all(len(lp.top_logprobs) == top for lp in logprobs)
        assert [lp.token for lp in logprobs] == [smollm2.decode([t], skip_special_tokens=False)
                                                 for t in ids[:len(pieces)]]
        assert all(bytes(lp.bytes) == lp.token.encode() for lp in logprobs)
    started = Response.model_validate(renderer.response(None))
    assert started.status == "in_progress" and started.output == [] and started.usage is None
