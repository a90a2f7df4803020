"""The HTTP gateway's request parsing and error mapping (pure: no server, no model)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.http import MAX_MESSAGES, MAX_N, HTTPError, parse_request
from tandem.protocol import RequestError, Status

CONTEXT = 2048
MESSAGES = [{"role": "user", "content": "hi"}]


def _error(kind: Any, body: Any) -> HTTPError:
    with pytest.raises(HTTPError) as info:
        parse_request(kind, body, CONTEXT, "req")
    return info.value


def test_chat_defaults_n_seeds_and_stop() -> None:
    parsed = parse_request("chat", {"model": "m", "messages": MESSAGES, "n": 3, "seed": 5, "stop": "END",
                                    "unknown": {"x": 1}, "user": "u"}, CONTEXT, "req")
    assert [r.request_id for r in parsed.requests] == ["req-0", "req-1", "req-2"]
    assert [r.sampling.seed for r in parsed.requests] == [5, 6, 7]
    first = parsed.requests[0]
    assert list(first.stop) == ["END"] and first.model == "m"
    assert first.sampling.temperature == 1.0 and first.sampling.max_tokens == CONTEXT  # OpenAI's defaults
    assert [(m.role, m.content) for m in first.messages.messages] == [("user", "hi")]
    assert not first.sampling.HasField("logprobs") and parsed.num_logprobs is None


def test_completion_prompt_forms_logprobs_and_max_completion_tokens() -> None:
    parsed = parse_request("completion", {"prompt": ["Hello"], "logprobs": 2, "max_tokens": 9}, CONTEXT, "r")
    assert parsed.requests[0].text == "Hello" and parsed.requests[0].sampling.logprobs == 2
    assert parsed.requests[0].sampling.max_tokens == 9
    ids = parse_request("completion", {"prompt": [1, 2, 3]}, CONTEXT, "r").requests[0]
    assert list(ids.token_ids.ids) == [1, 2, 3] and ids.sampling.max_tokens == 16
    chat = parse_request("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                           {"type": "text", "text": "b"}]}],
                                  "logprobs": True, "top_logprobs": 4, "max_completion_tokens": 3},
                         CONTEXT, "r")
    assert chat.num_logprobs == 4 and chat.requests[0].sampling.max_tokens == 3
    assert chat.requests[0].messages.messages[0].content == "ab"


@pytest.mark.parametrize(("kind", "body", "param"), [
    ("chat", [], None),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": MESSAGES * (MAX_MESSAGES + 1)}, "messages"),
    ("chat", {"messages": [{"content": "no role"}]}, "messages"),
    ("chat", {"messages": MESSAGES, "n": MAX_N + 1}, "n"),
    ("chat", {"messages": MESSAGES, "n": True}, "n"),
    ("chat", {"messages": MESSAGES, "temperature": float("nan")}, "temperature"),
    ("chat", {"messages": MESSAGES, "top_p": 0}, "top_p"),
    ("chat", {"messages": MESSAGES, "max_tokens": CONTEXT + 1}, "max_tokens"),
    ("chat", {"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
    ("chat", {"messages": MESSAGES, "seed": -1}, "seed"),
    ("chat", {"messages": MESSAGES, "stop": ["a"] * 17}, "stop"),
    ("chat", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ("chat", {"messages": MESSAGES, "logprobs": 3}, "logprobs"),
    ("chat", {"messages": MESSAGES, "stream": "yes"}, "stream"),
    ("completion", {"prompt": ["a", "b"]}, "prompt"),
    ("completion", {"prompt": [-1]}, "prompt"),
    ("completion", {"prompt": "a", "logprobs": 21}, "logprobs"),
])
def test_invalid_parameters_are_400_naming_the_parameter(kind: Any, body: Any, param: str | None) -> None:
    error = _error(kind, body)
    assert error.status == 400 and error.param == param
    assert error.body()["error"]["type"] == "invalid_request_error"


@settings(deadline=None)  # the first example imports the openai client
@given(st.floats(min_value=0.0005, max_value=120.0, allow_nan=False))
def test_a_refusals_hint_reaches_the_openai_client_to_the_millisecond(retry_after_s: float) -> None:
    import httpx
    import openai

    headers = HTTPError.from_error(RequestError(Status.RESOURCE_EXHAUSTED, "busy", retry_after_s)).headers
    assert int(headers["Retry-After"]) == max(1, math.ceil(retry_after_s))  # HTTP's whole seconds
    assert abs(int(headers["retry-after-ms"]) - max(1.0, retry_after_s * 1000)) <= 0.5
    # the openai client waits what retry-after-ms says, not the whole seconds of Retry-After
    client = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:1/v1")
    waited = client._parse_retry_after_header(httpx.Headers(headers))
    assert waited == pytest.approx(max(1, round(retry_after_s * 1000)) / 1000)


def test_a_refusal_without_a_hint_says_one_second() -> None:
    headers = HTTPError.from_error(RequestError(Status.RESOURCE_EXHAUSTED, "KV pool full")).headers
    assert headers == {"Retry-After": "1"}


def test_upstream_statuses_map_to_openai_errors() -> None:
    refused = HTTPError.from_error(RequestError(Status.RESOURCE_EXHAUSTED, "KV pool full"))
    assert refused.status == 429 and refused.headers["Retry-After"].isdigit()
    assert HTTPError.from_error(RequestError(Status.NOT_FOUND, "m")).body()["error"]["code"] == \
        "model_not_found"
    assert HTTPError.from_error(RequestError(Status.UNAVAILABLE, "down")).status == 503
    assert HTTPError.from_error(RequestError(Status.INVALID_ARGUMENT, "bad")).status == 400
    assert HTTPError.from_error(RequestError(Status.INTERNAL, "bug")).status == 500
