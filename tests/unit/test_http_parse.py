"""The HTTP gateway's request parsing and error mapping (pure: no server, no model)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.http import HTTPError, parse_request
from router.openai_types import MAX_BATCH_PROMPTS, MAX_CHOICES, MAX_N
from tandem.engine.grammar import grammar_for
from tandem.protocol import MAX_LOGIT_BIAS_TOKENS, MAX_MESSAGES, RequestError, Status

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


def test_logit_bias_and_stop_token_ids_reach_the_sampling_params() -> None:
    parsed = parse_request("chat", {"messages": MESSAGES, "n": 2, "logit_bias": {"7": 100, "0012": -2.5},
                                    "stop_token_ids": [3, 9]}, CONTEXT, "r")
    for request in parsed.requests:
        assert dict(request.sampling.logit_bias) == {7: 100.0, 12: -2.5}
        assert list(request.sampling.stop_token_ids) == [3, 9]
    assert not parse_request("chat", {"messages": MESSAGES}, CONTEXT, "r").requests[0].sampling.logit_bias


@settings(max_examples=40, deadline=None)
@given(chat=st.booleans(), include=st.booleans(), skip=st.booleans(), special=st.none() | st.booleans(),
       generation_prompt=st.booleans(), variables=st.dictionaries(st.text(min_size=1, max_size=8).filter(
           lambda k: k not in ("self", "messages", "tools", "add_generation_prompt", "continue_final_message")),
           st.integers() | st.text(max_size=8) | st.booleans(), max_size=3),
       n=st.integers(1, 3))
def test_vllm_text_and_chat_options_reach_every_choice(chat: bool, include: bool, skip: bool, special: bool | None,
                                                      generation_prompt: bool, variables: dict[str, Any],
                                                      n: int) -> None:
    body: dict[str, Any] = {"n": n, "include_stop_str_in_output": include, "skip_special_tokens": skip}
    if special is not None:
        body["add_special_tokens"] = special
    if chat:
        body.update(messages=MESSAGES, add_generation_prompt=generation_prompt,
                    continue_final_message=not generation_prompt, chat_template_kwargs=variables)
    else:
        body["prompt"] = ["a", "b"]
    parsed = parse_request("chat" if chat else "completion", body, CONTEXT, "r")
    assert len(parsed.requests) == n * (1 if chat else 2)
    for request in parsed.requests:
        assert request.include_stop_str_in_output is include
        # unset means true, as the proto documents
        assert (request.skip_special_tokens if request.HasField("skip_special_tokens") else True) is skip
        assert request.add_special_tokens is (special if special is not None else not chat)
        if chat:
            options = request.messages
            assert options.add_generation_prompt is generation_prompt
            assert options.continue_final_message is not generation_prompt
            assert (json.loads(options.chat_template_kwargs) if options.chat_template_kwargs else {}) == variables


@settings(max_examples=40, deadline=None)
@given(prompts=st.lists(st.text(min_size=1, max_size=5), min_size=1, max_size=5)
       | st.lists(st.lists(st.integers(0, 99), min_size=1, max_size=4), min_size=1, max_size=5),
       n=st.integers(1, 4), seed=st.none() | st.integers(0, 1000), echo=st.booleans())
def test_a_batch_of_prompts_is_n_choices_each_numbered_as_openai_does(
        prompts: list[Any], n: int, seed: int | None, echo: bool) -> None:
    body: dict[str, Any] = {"prompt": prompts, "n": n, "echo": echo}
    if seed is not None:
        body["seed"] = seed
    parsed = parse_request("completion", body, CONTEXT, "r")
    assert len(parsed.requests) == len(prompts) * n and parsed.echo == echo and parsed.prompts == prompts
    assert [r.request_id for r in parsed.requests] == [f"r-{i}" for i in range(len(prompts) * n)]
    for index, request in enumerate(parsed.requests):
        p = parsed.prompt_of[index]
        assert p == index // n
        sent = request.text if request.WhichOneof("prompt") == "text" else list(request.token_ids.ids)
        assert sent == prompts[p]
        if seed is not None:
            assert request.sampling.seed == seed + index % n


@pytest.mark.parametrize("body", [
    {"tools": [{"type": "function", "function": {"name": "f"}}], "prompt": "a"},
    {"tool_choice": "auto", "prompt": "a"},
    {"best_of": 2},
    {"suffix": "end"},
    {"prompt_logprobs": 1},
    {"modalities": ["text", "audio"]},
    {"echo": True},
    {"chat_template": "{{ messages }}"},
])
def test_what_would_change_the_output_and_is_not_implemented_is_refused(body: dict[str, Any]) -> None:
    kind = "completion" if set(body) & {"best_of", "suffix", "prompt"} else "chat"
    full = {**body, **({"prompt": "a"} if kind == "completion" else {"messages": MESSAGES})}
    error = _error(kind, full)
    assert error.status == 400 and error.param is not None and "not supported" in error.message
    assert error.param in body or (error.param == "modalities" and "audio" in str(body))


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "g", "description": "no arguments"}}]


@pytest.mark.parametrize(("choice", "forced"), [
    (None, False), ("auto", False), ("required", True), ({"type": "function", "function": {"name": "g"}}, True)])
def test_tools_reach_the_template_and_a_forced_choice_its_grammar(choice: Any, forced: bool) -> None:
    body = {"messages": MESSAGES, "tools": TOOLS, "n": 2, **({"tool_choice": choice} if choice else {})}
    parsed = parse_request("chat", body, CONTEXT, "r")
    assert parsed.tools is not None and parsed.tools.names == {"f", "g"}
    for request in parsed.requests:
        told = json.loads(request.messages.tools)
        assert [t["function"]["name"] for t in told] == ["f", "g"]
        assert told[1]["function"]["parameters"] == {"type": "object", "properties": {}}
        assert bool(request.sampling.grammar) == forced
        assert request.sampling.grammar == parsed.tools.grammar()
    none = parse_request("chat", {**body, "tool_choice": "none"}, CONTEXT, "r")
    assert none.tools is None and not none.requests[0].messages.tools


def test_earlier_calls_and_tool_answers_reach_the_core_and_bad_arguments_are_refused() -> None:
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"}]
    [request] = parse_request("chat", {"messages": history, "tools": TOOLS}, CONTEXT, "r").requests
    assistant, tool = request.messages.messages[1:]
    assert [(c.id, c.name, c.arguments) for c in assistant.tool_calls] == [("call_1", "f", '{"a": 1}')]
    assert (tool.role, tool.tool_call_id, tool.content) == ("tool", "call_1", "2")
    history[1]["tool_calls"][0]["function"]["arguments"] = "[1]"  # type: ignore[index]
    error = _error("chat", {"messages": history})
    assert error.param == "messages" and "JSON object" in error.message


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "h"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f f"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
])
def test_bad_tool_asks_are_refused_naming_the_parameter(body: dict[str, Any], param: str) -> None:
    error = _error("chat", {**body, "messages": MESSAGES})
    assert error.status == 400 and error.param == param, error.message


@pytest.mark.parametrize(("body", "kind", "spec"), [
    ({"response_format": {"type": "json_object"}}, "json_object", None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     "json", SCHEMA),
    ({"structured_outputs": {"json": SCHEMA}}, "json", SCHEMA),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json", SCHEMA),
    ({"structured_outputs": {"json_object": True, "regex": None}}, "json_object", None),
    ({"structured_outputs": {"regex": "[a-z]+"}}, "regex", "[a-z]+"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", ["yes", "no"]),
    ({"structured_outputs": {"grammar": 'start: "a"+'}}, "grammar", 'start: "a"+'),
    ({"guided_json": SCHEMA}, "json", SCHEMA),
    ({"guided_regex": "[0-9]{2}"}, "regex", "[0-9]{2}"),
    ({"guided_choice": ["a", "b"]}, "choice", ["a", "b"]),
    ({"guided_grammar": 'root ::= "x"'}, "grammar", 'root ::= "x"'),
])
@pytest.mark.parametrize("kind_of_request", ["chat", "completion"])
def test_structured_output_asks_become_the_grammar_of_every_choice(body: dict[str, Any], kind: str, spec: Any,
                                                                  kind_of_request: str) -> None:
    prompt = {"messages": MESSAGES} if kind_of_request == "chat" else {"prompt": ["a", "b"]}
    parsed = parse_request(kind_of_request, {**body, **prompt, "n": 2}, CONTEXT, "r")  # type: ignore[arg-type]
    assert {r.sampling.grammar for r in parsed.requests} == {grammar_for(kind, spec)}
    plain = parse_request(kind_of_request, {**prompt, "response_format": {"type": "text"}}, CONTEXT, "r")  # type: ignore[arg-type]
    assert all(r.sampling.grammar == "" for r in plain.requests)


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "grammar"}}, "response_format"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ({"structured_outputs": ["json"]}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"guided_json": "{nope"}, "guided_json"),
    ({"guided_regex": "(ab"}, "guided_regex"),
    ({"guided_grammar": 'start: a\na: b'}, "guided_grammar"),
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
])
def test_bad_or_doubled_structured_output_asks_are_refused_naming_the_parameter(body: dict[str, Any],
                                                                                 param: str) -> None:
    error = _error("chat", {**body, "messages": MESSAGES})
    assert error.status == 400 and error.param == param, error.message


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "text"}},
    {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"},
    {"tool_choice": "auto"},
    {"best_of": 1},
    {"modalities": ["text"]},
    {"echo": False},
])
def test_the_same_parameters_asking_for_nothing_are_accepted(body: dict[str, Any]) -> None:
    assert len(parse_request("chat", {**body, "messages": MESSAGES}, CONTEXT, "r").requests) == 1


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
    ("completion", {"prompt": []}, "prompt"),
    ("completion", {"prompt": ["a", []]}, "prompt"),
    ("completion", {"prompt": ["a"] * (MAX_BATCH_PROMPTS + 1)}, "prompt"),
    ("completion", {"prompt": "a", "echo": True, "logprobs": 0}, "echo"),
    ("completion", {"prompt": ["a"] * MAX_BATCH_PROMPTS, "n": MAX_CHOICES // MAX_BATCH_PROMPTS + 1}, "n"),
    ("chat", {"messages": MESSAGES, "logit_bias": {"x": 1}}, "logit_bias"),
    ("chat", {"messages": MESSAGES, "logit_bias": {"1": 100.5}}, "logit_bias"),
    ("chat", {"messages": MESSAGES, "logit_bias": {"1": "1"}}, "logit_bias"),
    ("chat", {"messages": MESSAGES, "logit_bias": {"4294967296": 1}}, "logit_bias"),
    ("chat", {"messages": MESSAGES, "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS_TOKENS + 1)}},
     "logit_bias"),
    ("chat", {"messages": MESSAGES, "stop_token_ids": [-1]}, "stop_token_ids"),
    ("completion", {"prompt": [-1]}, "prompt"),
    ("completion", {"prompt": "a", "logprobs": 21}, "logprobs"),
    ("chat", {"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
    ("chat", {"messages": MESSAGES, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ("chat", {"messages": MESSAGES, "chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
    ("chat", {"messages": MESSAGES, "include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ("completion", {"prompt": "a", "add_special_tokens": "no"}, "add_special_tokens"),
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
