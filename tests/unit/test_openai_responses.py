"""The OpenAI responses the router renders: typed once (router.openai_types), readable by the
`openai` client's own types, and described by the generated OpenAPI schema.

Random streams of GenerateResponses (choices, texts, logprobs, finish reasons, usage on or off)
are rendered as a client would receive them, whole and streamed.
"""

from __future__ import annotations

from typing import Any

import openai.types
import openai.types.chat
from hypothesis import given, settings
from hypothesis import strategies as st

from router.choices import ChoiceState, absorb
from router.http import HTTPError, ParsedRequest, Renderer
from router.openai_types import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    ErrorResponse,
    ModelList,
    openapi_schema,
)
from tandem.rpc.v1 import common_pb2, router_pb2


class _Tokenizer:
    """Stands in for the model's tokenizer: rendering only needs a token's text, and these tests
    check shapes, not vocabulary (the e2e tests render with the real one)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(f"<{i}>" if i % 7 else " é" for i in ids)


class _Core:
    tokenizer = _Tokenizer()
    model_id = "SmolLM2-135M-Instruct"
    context_length = 2048
    tool_format = "hermes"


FINISH = [common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH]


@st.composite
def streams(draw: st.DrawFn) -> tuple[ParsedRequest, list[list[router_pb2.GenerateResponse]]]:
    kind = draw(st.sampled_from(["chat", "completion"]))
    num_logprobs = draw(st.none() | st.integers(0, 3))
    num_choices = draw(st.integers(1, 3))
    prompts: list[str | list[int]] = []
    prompt_of: list[int] = []
    if kind == "completion":  # a batch of prompts, each with n choices (text or token ids, echoed or not)
        n = draw(st.integers(1, 3))
        prompts = draw(st.lists(st.text(max_size=6) | st.lists(st.integers(0, 50), min_size=1, max_size=3),
                                min_size=1, max_size=3))
        prompt_of = [p for p in range(len(prompts)) for _ in range(n)]
        num_choices = len(prompt_of)
    parsed = ParsedRequest(kind=kind, model=draw(st.sampled_from(["", "m"])), stream=True,
                           include_usage=draw(st.booleans()), num_logprobs=num_logprobs, prompt_of=prompt_of,
                           prompts=prompts, echo=kind == "completion" and num_logprobs is None and draw(st.booleans()))
    choices = []
    for i in range(num_choices):
        # the choices of one prompt report its prompt tokens alike
        prompt_tokens = 10 + prompt_of[i] if prompt_of else 10
        responses = []
        count = draw(st.integers(1, 4))
        for step in range(count):
            tokens = [common_pb2.GeneratedToken(
                token_id=token, logprob=-float(token % 5) if num_logprobs is not None else None,
                top_logprobs=[common_pb2.TopLogprob(token_id=token + k, logprob=-1.0 - k)
                              for k in range(num_logprobs or 0)])
                for token in draw(st.lists(st.integers(0, 50_000), min_size=0, max_size=3))]
            last = step == count - 1
            response = router_pb2.GenerateResponse(
                request_id="r", tokens=tokens, text=draw(st.text(max_size=8)),
                finish_reason=draw(st.sampled_from(FINISH)) if last else common_pb2.FINISH_REASON_UNSPECIFIED)
            if last:
                response.usage.CopyFrom(router_pb2.Usage(prompt_tokens=prompt_tokens,
                                                         completion_tokens=count, cached_tokens=0))
            responses.append(response)
        choices.append(responses)
    return parsed, choices


@settings(max_examples=60, deadline=None)
@given(streams())
def test_responses_are_what_the_openai_client_reads(stream: tuple[ParsedRequest, list[list[Any]]]) -> None:
    parsed, choices = stream
    renderer = Renderer(_Core(), parsed, "cmpl-1")  # type: ignore[arg-type]
    states = [ChoiceState() for _ in choices]
    events: list[dict[str, Any]] = []
    for index, responses in enumerate(choices):
        for response in responses:
            events.append(renderer.chunk(index, states[index], response))
            absorb(states[index], response)
    if parsed.include_usage:
        events.append(renderer.usage_chunk(states))
    whole = renderer.completion(states)

    chat = parsed.kind == "chat"
    client_whole = (openai.types.chat.ChatCompletion if chat else openai.types.Completion).model_validate(whole)
    ours_whole = (ChatCompletion if chat else Completion).model_validate(whole)
    assert ours_whole.model_dump(mode="json", exclude_unset=True) == whole
    assert len(client_whole.choices) == len(choices)
    assert client_whole.usage is not None
    assert client_whole.usage.completion_tokens == sum(len(r) for r in choices)
    # each prompt's tokens once, however many choices it has
    assert client_whole.usage.prompt_tokens == (sum(10 + p for p in range(len(parsed.prompts))) if parsed.prompts
                                                else 10)
    streamed: dict[int, str] = {}
    for event in events:
        for choice in event["choices"]:
            streamed[choice["index"]] = streamed.get(choice["index"], "") + (
                choice["delta"].get("content", "") if chat else choice["text"])
    for i, responses in enumerate(choices):
        text = "".join(r.text for r in responses)
        if parsed.echo:
            prompt = parsed.prompts[parsed.prompt_of[i]]
            text = (prompt if isinstance(prompt, str) else _Tokenizer().decode(prompt)) + text
        assert streamed[i] == text
        got = client_whole.choices[i]
        assert (got.message.content if chat else got.text) == text  # type: ignore[union-attr]
        assert (got.logprobs is None) == (parsed.num_logprobs is None)
    chunk_type = openai.types.chat.ChatCompletionChunk if chat else openai.types.Completion
    seen_role: set[int] = set()
    for event in events:
        if not chat and any(c["finish_reason"] is None for c in event["choices"]):
            # openai's Completion type says finish_reason is never null; its client reads stream
            # events without validating them, and OpenAI and vLLM send null before the last event.
            client_event = chunk_type.model_construct(**event)
        else:
            client_event = chunk_type.model_validate(event)
        assert ("usage" in event) == parsed.include_usage
        assert (ChatCompletionChunk if chat else Completion).model_validate(event).model_dump(
            mode="json", exclude_unset=True) == event
        for choice in event["choices"]:
            if chat:  # the role comes once per choice, in its first event
                assert ("role" in choice["delta"]) == (choice["index"] not in seen_role)
                seen_role.add(choice["index"])
        if not event["choices"]:
            assert client_event.usage is not None and client_event.usage.total_tokens == (
                client_whole.usage.total_tokens)


def test_errors_and_model_list_have_their_declared_shape() -> None:
    body = HTTPError(400, "temperature must be <= 2", param="temperature").body()
    assert ErrorResponse.model_validate(body).model_dump() == body
    assert body["error"]["code"] is None and body["error"]["param"] == "temperature"
    schema = openapi_schema(2048)
    components = schema["components"]["schemas"]
    for name in ("ChatCompletion", "ChatCompletionChunk", "Completion", "ModelList", "ErrorResponse"):
        assert name in components
    chat = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert chat["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletion")
    assert chat["429"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    models = schema["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert models["$ref"].endswith("/ModelList") and "data" in ModelList.model_json_schema()["properties"]
