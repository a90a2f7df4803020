"""The OpenAI-compatible HTTP API against the real stack (gpu_agent, prefill_svc, decode_svc and
router as processes), through the official ``openai`` client, httpx and a schemathesis fuzz.

Most tests run on a tiny random model with SmolLM2's tokenizer and chat template (fast, and every
text path is the real one); SmolLM2 itself serves the tests where the output must be right, and
its stack also has an API key and a KV pool too small for long prompts (admission refuses them).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import grpc
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tandem.client import TandemClient
from tandem.engine.grammar import grammar_for
from tandem.engine.llm import LLMEngine
from tandem.engine.sampling import SamplingParams
from tandem.engine.tokenizer import Tokenizer
from tandem.engine.tool_calls import chat_with_tools, check_tools, split_tool_calls
from tandem.rpc.v1 import agent_pb2, agent_pb2_grpc
from tests.integration.stack import Stack, metric_value, write_tiny_chat_model

pytestmark = pytest.mark.slow

TINY_BLOCKS = 4096
SMOL_BLOCKS = 64  # 1024 tokens of KV: a 1500-token prompt is refused by admission
API_KEY = "tandem-test-key"
CONTEXT = 2048  # the tiny model's context length
HELLO: list[Any] = [{"role": "user", "content": "Hello! Who are you?"}]  # openai wants its TypedDicts
# What the fuzz puts in malformed bodies; max_tokens is left out (its default can be the context).
PARAMS = ["model", "messages", "prompt", "n", "temperature", "top_p", "top_k", "min_p", "stop", "seed", "stream",
          "stream_options", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "ignore_eos", "user", "min_tokens", "logit_bias", "stop_token_ids", "echo",
          "response_format", "tools", "tool_choice", "suffix", "best_of", "include_stop_str_in_output",
          "skip_special_tokens", "add_special_tokens", "add_generation_prompt", "continue_final_message",
          "chat_template_kwargs", "chat_template", "input", "instructions", "max_output_tokens", "text",
          "previous_response_id", "include", "metadata"]


@pytest.fixture(scope="module")
def tiny(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("openai-tiny")
    model_dir = write_tiny_chat_model(root / "model", smollm2_dir)
    (root / "logs").mkdir()
    # A cell of its own: the cell id names the shared-memory weights and KV pool.
    with Stack(model_dir, root / "logs", num_blocks=TINY_BLOCKS,
               extra_env={"TANDEM_CELL_ID": f"oa-tiny-{uuid.uuid4().hex[:6]}"}) as stack:
        yield stack


@pytest.fixture(scope="module")
def smol(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with Stack(smollm2_dir, tmp_path_factory.mktemp("openai-smol-logs"), num_blocks=SMOL_BLOCKS,
               # a test kills prefill and decode: a request waits this long for them before its 503
               extra_env={"TANDEM_API_KEY": API_KEY, "TANDEM_CELL_ID": f"oa-smol-{uuid.uuid4().hex[:6]}",
                          "TANDEM_UPSTREAM_WAIT_S": "5"}) as stack:
        yield stack


@pytest.fixture(scope="module")
def smol_engine(smollm2_dir: Path) -> LLMEngine:
    """The in-process engine on the default model, in the weight format the stack runs (auto)."""
    return LLMEngine.from_dir(smollm2_dir, num_blocks=64)


def _client(stack: Stack, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_address()}/v1", api_key=api_key, max_retries=0, timeout=60)


def _async_client(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.http_address()}/v1", api_key="unused", max_retries=0, timeout=60)


async def _agent_stats(stack: Stack) -> agent_pb2.AgentStats:
    async with grpc.aio.insecure_channel(stack.address("gpu_agent")) as channel:
        return await agent_pb2_grpc.GpuAgentStub(channel).GetStats(agent_pb2.GetStatsRequest(), timeout=5)


async def _wait_all_blocks_free(stack: Stack, timeout_s: float) -> agent_pb2.AgentStats:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await _agent_stats(stack)
        if (stats.num_free_blocks == stats.num_blocks and stats.num_requests == 0) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


async def _leave_mid_stream(stack: Stack, path: str, body: dict[str, Any],
                            leave_after: int) -> tuple[agent_pb2.AgentStats, agent_pb2.AgentStats]:
    """Stream ``body`` to ``path`` and leave after ``leave_after`` events: the agent's stats while
    the stream is still open, and once every block is free again (or a minute passed)."""
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", f"{stack.http_address()}{path}", json=body) as response:
            assert response.status_code == 200
            events: list[str] = []
            # Held, not left to the loop: a generator left by ``break`` is closed at the next await
            # (asyncio finalizes it), and closing httpcore's closes the connection: the request
            # would be cancelled while the stats are being read.
            lines = response.aiter_lines()
            async for line in lines:
                if line.startswith("data: "):
                    events.append(line[:100])
                if len(events) >= leave_after:
                    break
            assert len(events) == leave_after, events  # the stream did not end by itself
            during = await _agent_stats(stack)
            del lines
    return during, await _wait_all_blocks_free(stack, timeout_s=60)


def _assert_error(response: httpx.Response, status: int, *words: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    for word in words:
        assert word in error["message"], error
    return dict(error)


# --- the openai client ----------------------------------------------------------------------------

def test_sync_client_chat_and_completions_streaming_and_not(tiny: Stack) -> None:
    client = _client(tiny)
    chat = client.chat.completions.create(model="default", messages=HELLO, max_tokens=12, temperature=0, user="u1",
                                          extra_body={"ignore_eos": True, "an_unknown_field": [1]})
    assert chat.object == "chat.completion" and len(chat.choices) == 1
    assert chat.choices[0].finish_reason == "length" and chat.choices[0].message.role == "assistant"
    assert chat.usage is not None and chat.usage.completion_tokens == 12
    assert chat.usage.prompt_tokens > 5 and chat.usage.total_tokens == chat.usage.prompt_tokens + 12

    chunks = list(client.chat.completions.create(model="default", messages=HELLO, max_tokens=12, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])

    text = client.completions.create(model="default", prompt="The capital of France is", max_tokens=7,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert text.object == "text_completion" and text.choices[0].finish_reason == "length"
    assert text.usage is not None and text.usage.completion_tokens == 7
    streamed = list(client.completions.create(model="default", prompt="The capital of France is", max_tokens=7,
                                              temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text
    # a token-id prompt is the same prompt
    ids = Tokenizer.from_dir(tiny.model_dir).encode("The capital of France is")
    by_ids = client.completions.create(model="default", prompt=ids, max_tokens=7, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == text.choices[0].text


def test_n_choices_and_seeds(tiny: Stack) -> None:
    client = _client(tiny)
    first = client.chat.completions.create(model="default", messages=HELLO, max_tokens=10, n=3, seed=7,
                                           temperature=1.0, extra_body={"ignore_eos": True})
    again = client.chat.completions.create(model="default", messages=HELLO, max_tokens=10, n=3, seed=7,
                                           temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices]  # seed + i: reproducible per choice
    assert len(set(texts)) == 3  # and different between choices
    assert first.usage is not None and first.usage.completion_tokens == 30

    chunks = list(client.completions.create(model="default", prompt="Once upon a time", max_tokens=6, n=2,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    per_choice = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            per_choice[choice.index] += choice.text
    assert per_choice[0] == per_choice[1] != ""  # greedy: both choices agree


def test_stop_strings_across_tokens_are_not_emitted(tiny: Stack) -> None:
    client = _client(tiny)
    full = client.completions.create(model="default", prompt="Tell me a story", max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(full) > 30
    stop = full[12:19]  # most likely spans a token boundary
    expected = full[:full.index(stop)]
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(model="default", prompt="Tell me a story", max_tokens=40,
                                                    temperature=0, stop=[stop, "\x00never"], stream=True,
                                                    extra_body={"ignore_eos": True}))
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            answer = client.completions.create(model="default", prompt="Tell me a story", max_tokens=40,
                                               temperature=0, stop=stop, extra_body={"ignore_eos": True})
            text, reason = answer.choices[0].text, answer.choices[0].finish_reason
        assert text == expected and reason == "stop"


def test_async_client_with_include_usage_and_logprobs(tiny: Stack) -> None:
    async def run() -> None:
        client = _async_client(tiny)
        stream = await client.chat.completions.create(
            model="default", messages=HELLO, max_tokens=5, temperature=0, stream=True, n=2,
            stream_options={"include_usage": True}, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 10
        assert all(c.usage is None for c in chunks[:-1])
        contents = [lp for c in chunks[:-1] for ch in c.choices if ch.logprobs and ch.logprobs.content
                    for lp in ch.logprobs.content]
        assert len(contents) == 10
        for lp in contents:
            assert len(lp.top_logprobs) == 3 and lp.logprob <= 0
            # greedy picks the most likely token
            assert lp.logprob >= lp.top_logprobs[0].logprob - 1e-4

        completion, chat = await asyncio.gather(
            client.completions.create(model="default", prompt="Hi", max_tokens=4, logprobs=2, temperature=0,
                                      extra_body={"ignore_eos": True}),
            client.chat.completions.create(model="default", messages=HELLO, max_tokens=4, temperature=0,
                                           extra_body={"ignore_eos": True}),
        )
        logprobs = completion.choices[0].logprobs
        assert logprobs is not None and logprobs.tokens is not None and len(logprobs.tokens) == 4
        assert "".join(logprobs.tokens) == completion.choices[0].text
        assert logprobs.top_logprobs is not None and all(len(t) == 2 for t in logprobs.top_logprobs)
        assert chat.usage is not None and chat.usage.completion_tokens == 4
        await client.close()

    asyncio.run(run())


def test_greedy_chat_equals_the_engine(smol: Stack, smollm2_dir: Path, smol_engine: LLMEngine) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]
    answer = _client(smol, API_KEY).chat.completions.create(model="default", messages=messages,  # type: ignore[arg-type]
                                                            max_tokens=24, temperature=0)
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    [want] = smol_engine.generate([tokenizer.encode_chat(messages)], SamplingParams(temperature=0.0, max_tokens=24))
    assert answer.choices[0].message.content == tokenizer.decode(want.token_ids)
    assert "Paris" in (answer.choices[0].message.content or "")
    assert answer.usage is not None and answer.usage.completion_tokens == len(want.token_ids)


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0},
                         "city": {"enum": ["Paris", "London", "Rome", "Berlin"]}}}


def test_json_schema_output_is_valid_and_equals_the_engine(smol: Stack, smollm2_dir: Path,
                                                           smol_engine: LLMEngine) -> None:
    """The real model asked for a person as JSON: the stack's answer (prefill samples the first
    token under the schema, decode the rest) keeps to the schema, ends by itself, and equals the
    in-process engine's under the same grammar, through the openai client and the gRPC SDK."""
    messages: list[Any] = [{"role": "user", "content": "Describe a person as JSON with a name, an age and a city."}]
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    answer = _client(smol, API_KEY).chat.completions.create(model="default", messages=messages, max_tokens=120,
                                                            temperature=0, response_format=fmt)  # type: ignore[arg-type]
    text = answer.choices[0].message.content or ""
    jsonschema.validate(json.loads(text), PERSON)
    assert answer.choices[0].finish_reason == "stop"
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    [want] = smol_engine.generate([tokenizer.encode_chat(messages)], SamplingParams(
        temperature=0.0, max_tokens=120, grammar=grammar_for("json", PERSON)))
    assert text == tokenizer.decode(want.token_ids), (text, tokenizer.decode(want.token_ids))
    with TandemClient(smol.address("router"), timeout_s=60, max_retries=0, api_key=API_KEY) as client:
        sdk = client.chat(messages, max_tokens=120, temperature=0.0, structured_outputs={"json": PERSON})
    assert sdk.text == text


def _bounded_schema(rng: random.Random) -> dict[str, Any]:
    """A random JSON schema whose every value has a most length (a random model's walk ends)."""
    def leaf() -> dict[str, Any]:
        return rng.choice([
            {"type": "integer", "minimum": -5, "maximum": rng.randint(0, 999)},
            {"type": "boolean"}, {"type": "null"},
            {"enum": rng.sample(["red", "green", "blue", "a \"b\"", "é"], rng.randint(1, 3))},
            {"type": "string", "maxLength": rng.randint(0, 6)},
            {"type": "array", "items": {"type": "boolean"}, "maxItems": rng.randint(0, 3)},
        ])
    names = rng.sample(["id", "ok", "tag", "x", "note", "n"], rng.randint(1, 4))
    return {"type": "object", "properties": {name: leaf() for name in names}, "additionalProperties": False,
            "required": rng.sample(names, rng.randint(0, len(names)))}


def test_structured_output_through_every_endpoint(tiny: Stack) -> None:
    """Random weights, random bounded schemas: chat (whole and streamed), completions, Responses,
    vLLM's structured_outputs and guided_* keep their shape; bad or doubled asks are 400s."""
    client, base = _client(tiny), tiny.http_address()
    rng = random.Random()
    seed = rng.randrange(10**6)
    rng.seed(seed)
    for _ in range(3):
        schema = _bounded_schema(rng)
        fmt: Any = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}}
        temperature = rng.choice([0.0, 1.0])
        whole = client.chat.completions.create(model="default", messages=HELLO, max_tokens=600, seed=seed,
                                               temperature=temperature, response_format=fmt)  # type: ignore[arg-type]
        assert whole.choices[0].finish_reason == "stop", (seed, schema, whole.choices[0].message.content)
        text = whole.choices[0].message.content or ""
        jsonschema.validate(json.loads(text), schema)
        streamed = client.chat.completions.create(model="default", messages=HELLO, max_tokens=600, seed=seed,
                                                  temperature=temperature, response_format=fmt,  # type: ignore[arg-type]
                                                  stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text, seed
        response = client.responses.create(model="default", input="hi", max_output_tokens=600, temperature=temperature,
                                           text={"format": {"type": "json_schema", "name": "thing", "schema": schema}})
        assert response.status == "completed", (seed, response.output_text)
        jsonschema.validate(json.loads(response.output_text), schema)
        assert response.text is not None and response.text.format is not None
        assert response.text.format.type == "json_schema"

    # the openai client's own helpers: a pydantic model as the schema, the answer parsed back
    class Thing(BaseModel):
        ok: bool
        color: Literal["red", "blue"]
        n: int = Field(ge=0, le=99)
        tags: list[Literal["a", "b"]] = Field(max_length=2)

    parsed = client.chat.completions.parse(model="default", messages=HELLO, max_tokens=300, temperature=0,
                                           response_format=Thing).choices[0]
    assert parsed.finish_reason == "stop" and isinstance(parsed.message.parsed, Thing), parsed
    answered = client.responses.parse(model="default", input="hi", max_output_tokens=300, temperature=0.0,
                                      text_format=Thing)
    assert answered.status == "completed" and isinstance(answered.output_parsed, Thing)
    with client.chat.completions.stream(model="default", messages=HELLO, max_tokens=300, temperature=0,
                                        response_format=Thing) as stream:
        for _ in stream:
            pass
        assert stream.get_final_completion().choices[0].message.parsed == parsed.message.parsed

    choices = ["alpha", "beta gamma", "δ"]
    picked = client.completions.create(model="default", prompt="Pick one:", max_tokens=20, temperature=1.0,
                                       extra_body={"structured_outputs": {"choice": choices}})
    assert picked.choices[0].text in choices and picked.choices[0].finish_reason == "stop"
    regex = client.chat.completions.create(model="default", messages=HELLO, max_tokens=30, temperature=1.0, seed=seed,
                                           extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", regex.choices[0].message.content or ""), seed
    grammar = client.chat.completions.create(model="default", messages=HELLO, max_tokens=30, temperature=0.0,
                                             extra_body={"guided_grammar": 'root ::= "(" [a-c] ("," [a-c])? ")"'})
    assert re.fullmatch(r"\([a-c](,[a-c])?\)", grammar.choices[0].message.content or "")
    # any object, until the budget ends: what came is where a JSON object may go
    anything = client.chat.completions.create(model="default", messages=HELLO, max_tokens=12, temperature=0.0,
                                              response_format={"type": "json_object"})
    assert (anything.choices[0].message.content or "").lstrip().startswith("{")

    chat = f"{base}/v1/chat/completions"
    with httpx.Client(timeout=30) as http:
        bad: list[tuple[dict[str, Any], str, str]] = [
            ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
             "response_format", "nonsense"),
            ({"response_format": {"type": "json_schema"}}, "response_format", "schema"),
            ({"response_format": {"type": "yaml"}}, "response_format", "json_object"),
            ({"guided_regex": "(ab"}, "guided_regex", "unclosed"),
            ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "structured_outputs", "exactly one"),
            ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice", "both"),
        ]
        for body, param, words in bad:
            error = _assert_error(http.post(chat, json={"model": "default", "messages": HELLO, **body}), 400, words)
            assert error["param"] == param, error


def test_logit_bias_and_echoed_batches_through_the_openai_client(tiny: Stack) -> None:
    client = _client(tiny)
    tokenizer = Tokenizer.from_dir(tiny.model_dir)
    rng = random.Random()
    seed = rng.randrange(10**6)
    rng.seed(seed)
    words = [t for t in rng.sample(range(100, 40_000), 400) if tokenizer.decode([t]).strip().isalpha()
             and tokenizer.decode([t]).isascii()]
    forced, prompts = words[0], [" ".join(rng.sample(["the", "sky", "is", "a", "cat", "one"], rng.randint(1, 5)))
                                 for _ in range(rng.randint(2, 4))]
    n, max_tokens = rng.randint(1, 2), rng.randint(2, 6)
    # a batch of prompts, n choices each, echoed, every token forced by +100
    got = client.completions.create(model="default", prompt=prompts, n=n, max_tokens=max_tokens, temperature=0,
                                    echo=True, logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert [c.index for c in got.choices] == list(range(len(prompts) * n)), seed
    for choice in got.choices:
        assert choice.text == prompts[choice.index // n] + tokenizer.decode([forced] * max_tokens), seed
    assert got.usage is not None and got.usage.completion_tokens == len(prompts) * n * max_tokens
    assert got.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts), seed
    streamed = [""] * len(got.choices)
    for chunk in client.completions.create(model="default", prompt=prompts, n=n, max_tokens=max_tokens,
                                           temperature=0, echo=True, stream=True,
                                           logit_bias={str(forced): 100}, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in got.choices], seed
    # -100 bans the token greedy decoding chose (the SDK over gRPC, the same sampling params)
    with TandemClient(tiny.address("router"), timeout_s=60) as sdk:
        for prompt in prompts:
            [first] = sdk.generate(prompt, max_tokens=1, temperature=0).token_ids
            again = sdk.generate(prompt, max_tokens=3, temperature=0, ignore_eos=True, logit_bias={first: -100.0})
            assert again.token_ids[0] != first, seed
            forced_ids = sdk.generate(prompt, max_tokens=3, temperature=0, ignore_eos=True,
                                      logit_bias={forced: 100.0}).token_ids
            assert forced_ids == (forced,) * 3, seed
    with httpx.Client(timeout=30) as http:
        _assert_error(http.post(f"{tiny.http_address()}/v1/chat/completions",
                                json={"model": "default", "messages": HELLO, "logit_bias": {"49152000": 1}}),
                      400, "logit_bias")
        _assert_error(http.post(f"{tiny.http_address()}/v1/chat/completions",
                                json={"model": "default", "messages": HELLO, "response_format": {"type": "xml"}}),
                      400, "response_format")


# --- errors ------------------------------------------------------------------------------------------

def test_errors_have_the_openai_shape(tiny: Stack) -> None:
    base = tiny.http_address()
    chat = f"{base}/v1/chat/completions"
    with httpx.Client(timeout=30) as http:
        _assert_error(http.post(chat, json={"model": "default", "messages": HELLO, "temperature": -1}),
                      400, "temperature")
        _assert_error(http.post(chat, json={"model": "default", "messages": HELLO, "temperature": "hot"}),
                      400, "temperature")
        _assert_error(http.post(chat, json={"model": "default", "messages": []}), 400, "messages")
        _assert_error(http.post(chat, json={"model": "default", "messages": HELLO * 1025}), 400, "1024")
        _assert_error(http.post(chat, json={"model": "default", "messages": HELLO, "n": 17}), 400, "n must")
        _assert_error(http.post(chat, json={"model": "default", "messages": HELLO, "max_tokens": CONTEXT + 1}),
                      400, str(CONTEXT))
        _assert_error(http.post(chat, json={"model": "default", "messages": HELLO, "stop": [1]}), 400, "stop")
        _assert_error(http.post(chat, content=b"{not json", headers={"content-type": "application/json"}),
                      400, "JSON")
        long_prompt = "hello " * (CONTEXT + 10)
        error = _assert_error(http.post(f"{base}/v1/completions", json={"model": "default", "prompt": long_prompt}),
                              400, str(CONTEXT), str(CONTEXT - 1))
        assert error["type"] == "invalid_request_error"
        _assert_error(http.post(chat, content=b" " * (4 * 1024 * 1024 + 1),
                                headers={"content-type": "application/json"}), 413, "limit")
        error = _assert_error(http.post(chat, json={"model": "gpt-17", "messages": HELLO}), 404, "gpt-17")
        assert error["code"] == "model_not_found"
        _assert_error(http.get(f"{base}/v1/nothing"), 404)
        # lone UTF-16 surrogates (valid JSON escapes, not Unicode text) anywhere: 400, never 5xx
        surrogate = "\\ud800"
        for raw, field in (
            ('{"model": "default", "messages": [{"role": "user", "content": "hi %s"}]}', "content"),
            ('{"model": "default", "messages": [{"role": "user", "content": "hi"}], "stop": ["%s"]}', "stop"),
            ('{"model": "d%sfault", "messages": [{"role": "user", "content": "hi"}]}', "model"),
        ):
            _assert_error(http.post(chat, content=(raw % surrogate).encode(),
                                    headers={"content-type": "application/json"}), 400, "surrogate", field)
        _assert_error(http.post(f"{base}/v1/completions", content=('{"model": "default", "prompt": "a%sb"}'
                                                                   % surrogate).encode(),
                                headers={"content-type": "application/json"}), 400, "surrogate", "prompt")
    client = _client(tiny)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-17", messages=HELLO)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model="default", prompt="hello " * (CONTEXT + 10))


def _assert_grpc_needs_the_key(address: str) -> None:
    """The public gRPC API follows the HTTP gateway's key: Generate and ListModels without it (or
    with a wrong one) end UNAUTHENTICATED; Health, and the standard grpc.health.v1 service, stay
    open for probes."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tandem.client import ClientError, TandemClient

    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING

    for key in (None, "wrong"):
        with TandemClient(address, timeout_s=30, max_retries=0, api_key=key) as client:
            assert client.health() is not None
            for call in (lambda: client.generate("Hi", max_tokens=2), client.models):
                with pytest.raises(ClientError, match="API key"):
                    call()
    with TandemClient(address, timeout_s=30, max_retries=0, api_key=API_KEY) as client:
        assert client.generate("Hi", max_tokens=2).text is not None


def test_a_forced_tool_call_of_the_real_model_equals_the_engine(smol: Stack, smollm2_dir: Path,
                                                                smol_engine: LLMEngine) -> None:
    """SmolLM2 (whose template does not render tools: they are told in a system message) made
    to call get_weather: the stack's arguments equal the in-process engine's under the same
    grammar and prompt, and name the city asked about; the gRPC SDK gets the same call."""
    messages: list[Any] = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    answer = _client(smol, API_KEY).chat.completions.create(
        model="default", messages=messages, max_tokens=60, temperature=0, tools=WEATHER,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = answer.choices[0].message.tool_calls or []
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    chat, tools = chat_with_tools(messages, check_tools(WEATHER), native=False)
    prompt = tokenizer.encode_chat(chat, tools=tools)
    [want] = smol_engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=60, grammar=grammar_for(
        "json", WEATHER[0]["function"]["parameters"])))
    assert call.function.arguments == tokenizer.decode(want.token_ids)
    assert answer.usage is not None and answer.usage.prompt_tokens == len(prompt)
    assert "Paris" in json.loads(call.function.arguments)["city"]
    with TandemClient(smol.address("router"), timeout_s=60, max_retries=0, api_key=API_KEY) as client:
        sdk = client.chat(messages, max_tokens=60, temperature=0.0, tools=WEATHER,
                          tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert [(c.name, c.arguments) for c in sdk.tool_calls] == [("get_weather", call.function.arguments)]


def test_api_key_admission_and_not_ready(smol: Stack) -> None:
    """Runs last of the tests on ``smol``: it kills the stack's prefill and decode."""
    base = smol.http_address()
    chat = f"{base}/v1/chat/completions"
    body = {"model": "default", "messages": HELLO, "max_tokens": 2}
    with httpx.Client(timeout=60) as http:
        _assert_error(http.post(chat, json=body), 401, "API key")
        _assert_error(http.post(chat, json=body, headers={"Authorization": "Bearer wrong"}), 401)
        _assert_error(http.get(f"{base}/v1/models"), 401)
        _assert_error(http.get(f"{base}/v1/models/default"), 401)
        _assert_error(http.post(f"{base}/tokenize", json={"prompt": "hi"}), 401)
        _assert_error(http.post(f"{base}/detokenize", json={"tokens": [1]}), 401)
        _assert_error(http.post(f"{base}/v1/responses", json={"input": "hi", "max_output_tokens": 2}), 401)
        _assert_error(http.get(f"{base}/v1/responses/resp_1"), 401)
        auth = {"Authorization": f"Bearer {API_KEY}"}
        assert http.post(chat, json=body, headers=auth).status_code == 200
        assert http.post(f"{base}/v1/responses", json={"input": "hi", "max_output_tokens": 2},
                         headers=auth).json()["status"] == "incomplete"
        # a prompt needing more KV blocks than the pool holds: admission refuses it
        long_body = {"model": "default", "prompt": "hello " * 1500, "max_tokens": 2}
        refused = http.post(f"{base}/v1/completions", json=long_body, headers=auth)
        _assert_error(refused, 429, "KV")
        assert refused.headers["retry-after"].isdigit()
        with pytest.raises(openai.RateLimitError):
            _client(smol, API_KEY).completions.create(model="default", prompt="hello " * 1500, max_tokens=2)
        # /metrics needs the key; /ready answers anyone but names internal addresses only to it
        _assert_error(http.get(f"{base}/metrics"), 401)
        assert "tandem:" in http.get(f"{base}/metrics", headers=auth).text
        assert "127.0.0.1" not in http.get(f"{base}/ready").text
        assert "127.0.0.1" in http.get(f"{base}/ready", headers=auth).text
        _assert_grpc_needs_the_key(smol.address("router"))
        assert http.get(f"{base}/ready").status_code == 200
        assert http.get(f"{base}/ping").status_code == 200 and http.post(f"{base}/ping").status_code == 200
        for name in ("gpu_agent", "prefill_svc", "decode_svc", "router"):  # a container's healthcheck
            assert _probe(smol.address(name)) == (0, "SERVING"), name
        assert _probe(smol.address("router"), "--ready") == (0, "ready")
        # without prefill and decode the router is not ready and generation is unavailable
        smol.kill("prefill_svc")
        smol.kill("decode_svc")
        _assert_error(http.get(f"{base}/ready", headers=auth), 503, "prefill")
        assert http.get(f"{base}/ping").status_code == 503 and http.post(f"{base}/ping").status_code == 503
        _assert_error(http.post(chat, json=body, headers=auth), 503)
        assert http.get(f"{base}/health").status_code == 200
        code, said = _probe(smol.address("router"), "--ready")
        assert code == 1 and said.startswith("not ready") and "prefill" in said
        assert _probe(smol.address("router")) == (0, "SERVING")
        code, said = _probe(smol.address("decode_svc"))
        assert code == 1 and said.startswith("UNAVAILABLE"), said


def _probe(address: str, *flags: str) -> tuple[int, str]:
    """``python -m tandem.health_cli ADDRESS`` as compose's healthchecks run it: (exit code, what
    it said after the address)."""
    done = subprocess.run([sys.executable, "-m", "tandem.health_cli", address, *flags], capture_output=True,
                          text=True, timeout=60)
    said = (done.stdout + done.stderr).strip()
    assert said.startswith(f"{address}: "), said
    return done.returncode, said.removeprefix(f"{address}: ")


# --- lifecycle and load ----------------------------------------------------------------------------

def test_disconnect_mid_stream_cancels_upstream_and_frees_every_block(tiny: Stack) -> None:
    max_tokens = 1900

    async def run() -> tuple[agent_pb2.AgentStats, agent_pb2.AgentStats, float, float]:
        body = {"model": "default", "messages": HELLO, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        event_times_s: list[float] = []
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", f"{tiny.http_address()}/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                lines = response.aiter_lines()  # held: see _leave_mid_stream
                async for line in lines:
                    if line.startswith("data: "):
                        event_times_s.append(time.monotonic())
                    if len(event_times_s) >= 8:  # early: a tiny model streams 1900 tokens in about a second
                        break
                during = await _agent_stats(tiny)
                del lines
        left_s = time.monotonic()
        after = await _wait_all_blocks_free(tiny, timeout_s=60)
        tokens_per_s = (len(event_times_s) - 1) / (event_times_s[-1] - event_times_s[0])
        return during, after, time.monotonic() - left_s, tokens_per_s

    during, after, freed_in_s, tokens_per_s = asyncio.run(run())
    assert during.num_requests == 1 and during.num_free_blocks < during.num_blocks
    assert after.num_free_blocks == after.num_blocks and after.num_requests == 0
    # Cancelled, not finished: the blocks came back long before the rest of the tokens could
    # have been generated at the rate they were streaming.
    assert freed_in_s < max(5.0, 0.5 * (max_tokens - 8) / tokens_per_s), (freed_in_s, tokens_per_s)

    # the same for a non-streaming request whose client gives up waiting, at random moments of
    # its decode: a cancellation that lands as a token arrives must not be lost (it was, about one
    # time in fifteen, when the router waited for tokens with asyncio.wait_for)
    async def give_up(wait_s: float) -> tuple[agent_pb2.AgentStats, float]:
        body = {"model": "default", "prompt": "Once", "max_tokens": max_tokens, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=wait_s) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post(f"{tiny.http_address()}/v1/completions", json=body)
        left_s = time.monotonic()
        stats = await _wait_all_blocks_free(tiny, timeout_s=60)
        return stats, time.monotonic() - left_s

    for wait_s in random.Random().sample([0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9], 4):
        after, freed_in_s = asyncio.run(give_up(wait_s))
        assert after.num_free_blocks == after.num_blocks and after.num_requests == 0
        assert freed_in_s < max(5.0, 0.5 * max_tokens / tokens_per_s), (wait_s, freed_in_s, tokens_per_s)

    # a streamed batch of prompts with n choices each: leaving mid-stream cancels every one
    rng = random.Random()
    body = {"model": "default", "prompt": ["Once", "The sky", "1, 2,"][:rng.randint(2, 3)], "n": rng.randint(1, 3),
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "echo": rng.random() < 0.5}
    during, after = asyncio.run(_leave_mid_stream(tiny, "/v1/completions", body, rng.randint(3, 20)))
    assert during.num_requests >= 1
    assert after.num_free_blocks == after.num_blocks and after.num_requests == 0
    metrics = httpx.get(f"{tiny.http_address()}/metrics").text
    assert metric_value(metrics, "tandem:num_requests_running") == 0
    assert metric_value(metrics, "tandem:num_requests_waiting") == 0


def test_models_health_ready_metrics_openapi(tiny: Stack) -> None:
    base = tiny.http_address()
    with httpx.Client(timeout=30) as http:
        models = http.get(f"{base}/v1/models").json()
        assert models["object"] == "list" and models["data"][0]["id"] == "model"
        assert models["data"][0]["max_model_len"] == CONTEXT
        assert http.get(f"{base}/health").json() == {"status": "ok"}
        assert http.get(f"{base}/ready").status_code == 200
        http.post(f"{base}/v1/completions", json={"model": "default", "prompt": "Hi", "max_tokens": 3})
        metrics = http.get(f"{base}/metrics").text
        for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                     "request_queue_time_seconds", "num_requests_running", "num_requests_waiting",
                     "kv_cache_usage_perc", "prefix_cache_hit_rate", "partition_prefill_units",
                     "partition_decode_units"):
            assert f"# TYPE tandem:{name} " in metrics, name
        assert metric_value(metrics, "tandem:time_to_first_token_seconds_count") > 0
        assert f'tandem:time_to_first_token_seconds_count{{model_name="{tiny.model_dir.name}"}}' in metrics
        label = f'{{model_name="{tiny.model_dir.name}"}}'
        # every metric carries the model, the cell's gauges and the scheduler's counts included
        for name in ("kv_cache_usage_perc", "partition_prefill_units", "num_preemptions_total",
                     "num_requests_dropped_total"):
            assert f"tandem:{name}{label}" in metrics, name
        units = {line.split()[0].removesuffix(label): float(line.split()[1]) for line in metrics.splitlines()
                 if line.startswith("tandem:partition_")}
        # read from the agent's load report (the policy may give every unit to one phase)
        assert units["tandem:partition_prefill_units"] + units["tandem:partition_decode_units"] >= 1
        assert units["tandem:partition_epoch"] >= 1
        schema = http.get(f"{base}/openapi.json").json()
        assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model}", "/tokenize",
                "/detokenize"} <= set(schema["paths"])
        assert http.get(f"{base}/version").json()["version"]


def _tools(rng: random.Random) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": name, "description": f"does {name}",
                                              "parameters": _bounded_schema(rng)}}
            for name in rng.sample(["get_weather", "add", "look-up", "send_mail"], rng.randint(1, 3))]


def _schema_of(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)


def test_tool_calls_through_the_openai_client(tiny: Stack) -> None:
    """Random weights, random tools with bounded schemas: a forced call (named or required, whole
    and streamed, n choices) names a tool and keeps to its schema; in auto mode the answer is
    what the model's raw text reads as (the same prompt through /tokenize and /v1/completions),
    and a block forced by a regex comes back as a call; earlier calls and tool answers render;
    bad asks are 400s naming the parameter."""
    client, base = _client(tiny), tiny.http_address()
    rng = random.Random()
    seed = rng.randrange(10**6)
    rng.seed(seed)
    for _ in range(3):
        tools = _tools(rng)
        named = rng.choice(tools)["function"]["name"]
        choice: Any = {"type": "function", "function": {"name": named}}
        whole = client.chat.completions.create(model="default", messages=HELLO, max_tokens=600, temperature=0,
                                               tools=tools, tool_choice=choice)  # type: ignore[arg-type]
        message = whole.choices[0].message
        assert whole.choices[0].finish_reason == "stop" and message.content is None, (seed, message)
        [call] = message.tool_calls or []
        assert call.type == "function" and call.function.name == named and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), _schema_of(tools, named))
        with client.chat.completions.stream(model="default", messages=HELLO, max_tokens=600, temperature=0,
                                            tools=tools, tool_choice=choice) as stream:  # type: ignore[arg-type]
            for _ in stream:
                pass
            [again] = stream.get_final_completion().choices[0].message.tool_calls or []
        assert (again.function.name, again.function.arguments) == (named, call.function.arguments), seed

        parallel = rng.choice([True, False])
        forced = client.chat.completions.create(model="default", messages=HELLO, max_tokens=900, temperature=1.0,
                                                seed=seed, n=2, tools=tools, tool_choice="required",  # type: ignore[arg-type]
                                                parallel_tool_calls=parallel)
        for answer in forced.choices:
            assert answer.finish_reason == "tool_calls", (seed, answer)
            calls = answer.message.tool_calls or []
            assert calls and (parallel or len(calls) == 1) and len({c.id for c in calls}) == len(calls)
            for made in calls:
                jsonschema.validate(json.loads(made.function.arguments), _schema_of(tools, made.function.name))
        streamed = client.chat.completions.create(model="default", messages=HELLO, max_tokens=900, temperature=1.0,
                                                  seed=seed, n=2, tools=tools, tool_choice="required",  # type: ignore[arg-type]
                                                  parallel_tool_calls=parallel, stream=True)
        pieces: dict[int, list[Any]] = {0: [], 1: []}
        for chunk in streamed:
            for c in chunk.choices:
                pieces[c.index].extend(c.delta.tool_calls or [])
        for i, answer in enumerate(forced.choices):
            assert [(p.function.name, p.function.arguments) for p in pieces[i]] == [
                (c.function.name, c.function.arguments) for c in answer.message.tool_calls or []], seed

        # auto: the answer is what the raw text of the same prompt reads as
        counted = httpx.post(f"{base}/tokenize", json={"messages": HELLO, "tools": tools}, timeout=30).json()
        plain = httpx.post(f"{base}/tokenize", json={"messages": HELLO}, timeout=30).json()
        assert counted["count"] > plain["count"]
        raw = client.completions.create(model="default", prompt=counted["tokens"], max_tokens=40, temperature=0)
        auto = client.chat.completions.create(model="default", messages=HELLO, max_tokens=40, temperature=0,
                                              tools=tools)  # type: ignore[arg-type]
        assert auto.usage is not None and auto.usage.prompt_tokens == counted["count"]
        content, calls = split_tool_calls(raw.choices[0].text, frozenset(t["function"]["name"] for t in tools))
        assert (auto.choices[0].message.content or "", [(c.name, c.arguments) for c in calls]) == (
            content, [(c.function.name, c.function.arguments) for c in auto.choices[0].message.tool_calls or []])

        # auto, with the model's answer held to a block by a regex: read back as a call
        number = rng.randint(0, 99)
        block = r"Sure\.\n<tool_call>\n\{\"name\": \"" + re.escape(named) + r'\", \"arguments\": \{\"n\": ' + \
            str(number) + r"\}\}\n</tool_call>"
        held = client.chat.completions.create(model="default", messages=HELLO, max_tokens=80, temperature=1.0,
                                              tools=tools, extra_body={"structured_outputs": {"regex": block}})  # type: ignore[arg-type]
        assert held.choices[0].finish_reason == "tool_calls" and held.choices[0].message.content == "Sure."
        [got] = held.choices[0].message.tool_calls or []
        assert (got.function.name, json.loads(got.function.arguments)) == (named, {"n": number})
        chunks = list(client.chat.completions.create(
            model="default", messages=HELLO, max_tokens=80, temperature=1.0, tools=tools, stream=True,  # type: ignore[arg-type]
            extra_body={"structured_outputs": {"regex": block}}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Sure."
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"

        # the call and its answer go back to the model as history
        history: list[Any] = [*HELLO, message.model_dump(exclude_none=True),
                              {"role": "tool", "tool_call_id": call.id, "content": "it is done"}]
        rendered = httpx.post(f"{base}/tokenize", json={"messages": history, "tools": tools}, timeout=30).json()
        text = httpx.post(f"{base}/detokenize", json={"tokens": rendered["tokens"]}, timeout=30).json()["prompt"]
        assert f'"name": "{named}"' in text and "<tool_response>\nit is done\n</tool_response>" in text
        after = client.chat.completions.create(model="default", messages=history, max_tokens=5, tools=tools)  # type: ignore[arg-type]
        assert after.usage is not None and after.usage.prompt_tokens == rendered["count"]

    chat = f"{base}/v1/chat/completions"
    tool = {"type": "function", "function": {"name": "f"}}
    with httpx.Client(timeout=30) as http:
        bad: list[tuple[dict[str, Any], str, str]] = [
            ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools", "letters"),
            ({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "not among"),
            ({"tool_choice": "required"}, "tool_choice", "no tools"),
            ({"tools": [tool], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
             "response_format"),
            ({"functions": [{"name": "f"}]}, "functions", "tools"),
            ({"tools": [tool], "messages": [*HELLO, {"role": "assistant", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "nope"}}]}]}, "messages", "JSON"),
        ]
        for body, param, words in bad:
            error = _assert_error(http.post(chat, json={"model": "default", "messages": HELLO, **body}), 400, words)
            assert error["param"] == param, error
        _assert_error(http.post(f"{base}/v1/completions", json={"prompt": "a", "tools": [tool]}), 400, "chat")


def test_function_tools_through_the_responses_api(tiny: Stack) -> None:
    """The Responses API's function tools on random weights: forced calls are function_call
    items keeping to their tool's schema, whole and through the openai client's stream helper
    (which rebuilds the response from the events); a regex-held auto answer gives a message and
    a call; function_call and function_call_output input items render as the chat's history;
    built-in tools are refused."""
    client = _client(tiny)
    rng = random.Random()
    seed = rng.randrange(10**6)
    rng.seed(seed)
    for _ in range(2):
        tools = [{"type": "function", **t["function"]} for t in _tools(rng)]
        named = rng.choice(tools)["name"]
        for choice in ({"type": "function", "name": named}, "required"):
            whole = client.responses.create(model="default", input="hi", tools=tools, tool_choice=choice,  # type: ignore[arg-type]
                                            temperature=0.0, max_output_tokens=900, parallel_tool_calls=False)
            assert whole.status == "completed", (seed, whole.output)
            [call] = whole.output
            assert call.type == "function_call" and call.call_id.startswith("call_") and call.id.startswith("fc_")
            assert choice == "required" or call.name == named
            schema = next(t["parameters"] for t in tools if t["name"] == call.name)
            jsonschema.validate(json.loads(call.arguments), schema)
            with client.responses.stream(model="default", input="hi", tools=tools, tool_choice=choice,  # type: ignore[arg-type]
                                         temperature=0.0, max_output_tokens=900, parallel_tool_calls=False) as stream:
                events = list(stream)
                final = stream.get_final_response()
            [again] = final.output
            assert again.type == "function_call" and (again.name, again.arguments) == (call.name, call.arguments)
            deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
            done = [e for e in events if e.type == "response.function_call_arguments.done"]
            assert deltas == call.arguments and [e.arguments for e in done] == [call.arguments]
            added = [e.item for e in events if e.type == "response.output_item.added"]
            assert [(i.type, i.id) for i in added] == [("function_call", again.id)]

        number = rng.randint(0, 99)
        block = r"Sure\.\n<tool_call>\n\{\"name\": \"" + re.escape(named) + r'\", \"arguments\": \{\"n\": ' + \
            str(number) + r"\}\}\n</tool_call>"
        held = client.responses.create(model="default", input="hi", tools=tools, temperature=1.0,  # type: ignore[arg-type]
                                       max_output_tokens=80, extra_body={"structured_outputs": {"regex": block}})
        with client.responses.stream(model="default", input="hi", tools=tools, temperature=1.0,  # type: ignore[arg-type]
                                     max_output_tokens=80, extra_body={"structured_outputs": {"regex": block}}) as stream:
            for _ in stream:
                pass
            streamed = stream.get_final_response()
        for answer in (held, streamed):
            assert [o.type for o in answer.output] == ["message", "function_call"], (seed, answer.output)
            assert answer.output_text == "Sure."
            assert (answer.output[1].name, json.loads(answer.output[1].arguments)) == (named, {"n": number})  # type: ignore[union-attr]

        items: list[Any] = [{"role": "user", "content": "hi"},
                            {"type": "function_call", "call_id": "call_7", "name": named, "arguments": '{"n": 1}'},
                            {"type": "function_call_output", "call_id": "call_7", "output": "done"}]
        after = client.responses.create(model="default", input=items, tools=tools, max_output_tokens=4)  # type: ignore[arg-type]
        chat = client.chat.completions.create(model="default", max_tokens=4, tools=[  # type: ignore[arg-type]
            {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in tools], messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [{"id": "call_7", "type": "function",
                                                  "function": {"name": named, "arguments": '{"n": 1}'}}]},
            {"role": "tool", "tool_call_id": "call_7", "content": "done"}])
        assert after.usage is not None and chat.usage is not None
        assert after.usage.input_tokens == chat.usage.prompt_tokens, seed

    with httpx.Client(timeout=30) as http:
        url = f"{tiny.http_address()}/v1/responses"
        for body, param, words in [
            ({"tools": [{"type": "web_search"}]}, "tools", "built-in"),
            ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "file_search"}}, "tool_choice",
             "file_search"),
            ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
             "tool_choice", "not among"),
            ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[]"}]}, "input", "JSON"),
        ]:
            error = _assert_error(http.post(url, json={"model": "default", "input": "hi", **body}), 400, words)
            assert error["param"] == param, error


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"], "properties": {
        "city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}]


def test_retrieve_a_model_and_tokenize_as_generation_does(tiny: Stack) -> None:
    client = _client(tiny)
    for name in ("model", "default"):
        card = client.models.retrieve(name)
        assert card.id == "model" and card.model_extra == {"max_model_len": CONTEXT}
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")
    base = tiny.http_address()
    rng = random.Random()
    seed = rng.randrange(10**6)
    rng.seed(seed)
    alphabet = "abcdefghij klmnopqrstuvwxyz.,!?0123456789éß"
    with httpx.Client(timeout=30) as http:
        for _ in range(4):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
            counted = http.post(f"{base}/tokenize", json={"model": "default", "prompt": text}).json()
            done = client.completions.create(model="default", prompt=text, max_tokens=1)
            assert done.usage is not None and counted["count"] == done.usage.prompt_tokens == len(counted["tokens"])
            assert counted["max_model_len"] == CONTEXT
            back = http.post(f"{base}/detokenize", json={"tokens": counted["tokens"]}).json()
            assert back == {"prompt": text}, seed
            messages: list[Any] = [{"role": "user", "content": text}]
            chat = http.post(f"{base}/tokenize", json={"messages": messages}).json()
            reply = client.chat.completions.create(model="default", messages=messages, max_tokens=1)
            assert reply.usage is not None and chat["count"] == reply.usage.prompt_tokens, seed
            assert chat["tokens"] == Tokenizer.from_dir(tiny.model_dir).encode_chat(messages), seed
        _assert_error(http.post(f"{base}/tokenize", json={}), 400, "prompt")
        _assert_error(http.post(f"{base}/tokenize", json={"prompt": "a", "messages": HELLO}), 400, "one of")
        _assert_error(http.post(f"{base}/tokenize", json={"prompt": "a", "model": "gpt-17"}), 404, "gpt-17")
        _assert_error(http.post(f"{base}/tokenize", json={"prompt": "hello " * (CONTEXT + 10)}), 400,
                      str(CONTEXT))
        _assert_error(http.post(f"{base}/detokenize", json={"tokens": [10**9]}), 400, "out of range")
        _assert_error(http.post(f"{base}/detokenize", json={"tokens": "1 2"}), 400, "tokens")


def test_vllm_chat_template_and_text_options(tiny: Stack) -> None:
    """continue_final_message, add_generation_prompt, chat_template_kwargs, include_stop_str_in_output
    and skip_special_tokens, as vLLM's clients send them (extra_body), on random texts."""
    client, base = _client(tiny), tiny.http_address()
    tokenizer = Tokenizer.from_dir(tiny.model_dir)
    rng = random.Random()
    seed = rng.randrange(10**6)
    rng.seed(seed)
    words = ["the", "answer", "is", "blue", "Paris", "a", "long", "story", "é", "42", ","]
    with httpx.Client(timeout=30) as http:
        for _ in range(3):
            start = " ".join(rng.choice(words) for _ in range(rng.randint(1, 6)))
            messages: list[Any] = [{"role": "user", "content": " ".join(rng.choices(words, k=5))},
                                   {"role": "assistant", "content": start}]
            options = {"add_generation_prompt": False, "continue_final_message": True}
            counted = http.post(f"{base}/tokenize", json={"messages": messages, **options}).json()
            # the prompt is the conversation up to the assistant's text, without its end of turn
            rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
            assert counted["tokens"] == tokenizer.encode(rendered.removesuffix("<|im_end|>\n"),
                                                         add_special_tokens=False), seed
            chat = client.chat.completions.create(model="default", messages=messages, max_tokens=6, temperature=0,
                                                  extra_body={**options, "ignore_eos": True})
            assert chat.usage is not None and chat.usage.prompt_tokens == counted["count"], seed
            # generation continued from exactly those ids: the same greedy tokens as a raw prompt of them
            raw = client.completions.create(model="default", prompt=counted["tokens"], max_tokens=6, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert chat.choices[0].message.content == raw.choices[0].text, seed
            closed = http.post(f"{base}/tokenize", json={"messages": messages, "add_generation_prompt": False,
                                                         "chat_template_kwargs": {"unused_variable": 1}}).json()
            assert closed["tokens"] == tokenizer.encode(rendered, add_special_tokens=False), seed

        full = client.completions.create(model="default", prompt="Once upon", max_tokens=30, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
        cut = rng.randrange(4, len(full) - 6)
        stop = full[cut:cut + rng.randint(1, 5)]
        want = full[:full.index(stop) + len(stop)]
        for stream in (False, True):
            body = {"model": "default", "prompt": "Once upon", "max_tokens": 30, "temperature": 0, "stop": [stop],
                    "ignore_eos": True, "include_stop_str_in_output": True, "stream": stream}
            response = http.post(f"{base}/v1/completions", json=body)
            if stream:
                chunks = [json.loads(line[6:]) for line in response.text.splitlines()
                          if line.startswith("data: {")]
                text = "".join(c["choices"][0]["text"] for c in chunks)
                finish = chunks[-1]["choices"][0]["finish_reason"]
            else:
                text, finish = response.json()["choices"][0]["text"], response.json()["choices"][0]["finish_reason"]
            assert (text, finish) == (want, "stop"), (seed, stop)

        # the end-of-turn token, forced: in the text only when special tokens are not skipped
        [end_id] = tokenizer.encode("<|im_end|>", add_special_tokens=False)
        for skip, expected in ((True, ""), (False, "<|im_end|>" * 3)):
            answer = client.chat.completions.create(
                model="default", messages=HELLO, max_tokens=3, temperature=0, logit_bias={str(end_id): 100},
                extra_body={"ignore_eos": True, "skip_special_tokens": skip})
            assert answer.choices[0].message.content == expected, seed

        refused: list[tuple[dict[str, Any], str]] = [
            ({"continue_final_message": True}, "continue_final_message"),
            ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
            ({"chat_template": "{{ 1 }}"}, "chat_template")]
        for body, param in refused:
            error = _assert_error(http.post(f"{base}/v1/chat/completions",
                                            json={"messages": HELLO, "max_tokens": 2, **body}), 400)
            assert error["param"] == param, error
        _assert_error(http.post(f"{base}/v1/chat/completions", json={
            "messages": [*HELLO, {"role": "assistant", "content": "  "}], "max_tokens": 2,
            "add_generation_prompt": False, "continue_final_message": True}), 400, "text to continue")


def test_responses_api_through_the_openai_client(tiny: Stack) -> None:
    """client.responses.create, whole and streamed, is the chat request it means; every event parses
    as the client's own type; leaving a streamed response frees its blocks."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    client, base = _client(tiny), tiny.http_address()
    rng = random.Random()
    seed = rng.randrange(10**6)
    rng.seed(seed)
    words = ["the", "sky", "is", "blue", "Paris", "a", "story", "é", "42", "why"]
    read_event: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    for _ in range(3):
        question = " ".join(rng.choices(words, k=rng.randint(1, 8)))
        instructions = rng.choice([None, "Answer briefly.", "Be kind."])
        k = rng.randint(1, 12)
        chat: list[Any] = ([{"role": "system", "content": instructions}] if instructions else []) + [
            {"role": "user", "content": question}]
        want = client.chat.completions.create(model="default", messages=chat, max_tokens=k, temperature=0,
                                              extra_body={"ignore_eos": True})
        whole = client.responses.create(model="default", input=question, instructions=instructions,
                                        max_output_tokens=k, temperature=0, extra_body={"ignore_eos": True})
        assert whole.output_text == want.choices[0].message.content, seed
        assert whole.status == "incomplete" and whole.incomplete_details is not None, seed
        assert whole.incomplete_details.reason == "max_output_tokens"
        assert whole.usage is not None and want.usage is not None
        assert (whole.usage.input_tokens, whole.usage.output_tokens) == (want.usage.prompt_tokens, k), seed

        with httpx.Client(timeout=60) as http:
            body = {"model": "default", "input": [{"role": "user", "content": [{"type": "input_text",
                                                                                 "text": question}]}],
                    "instructions": instructions, "max_output_tokens": k, "temperature": 0, "stream": True,
                    "ignore_eos": True}
            lines = http.post(f"{base}/v1/responses", json=body).text.splitlines()
        names = [line[7:] for line in lines if line.startswith("event: ")]
        events = [read_event.validate_python(json.loads(line[6:])) for line in lines if line.startswith("data: ")]
        assert [e.type for e in events] == names and [e.sequence_number for e in events] == list(range(len(events)))
        assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"], seed
        assert names[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                              "response.incomplete"], seed
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == events[-4].text == whole.output_text, seed
        assert events[-1].response.output_text == whole.output_text and events[-1].response.id == events[0].response.id

    # logprobs when included: the chat endpoint's, token by token; streamed with each delta
    chat_lp = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hello"}],
                                             max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
                                             extra_body={"ignore_eos": True})
    with_lp = client.responses.create(model="default", input="hello", max_output_tokens=5, temperature=0,
                                      include=["message.output_text.logprobs"], top_logprobs=2,
                                      extra_body={"ignore_eos": True})
    message = with_lp.output[0]
    assert message.type == "message"
    [part] = message.content
    assert part.type == "output_text" and part.logprobs is not None
    assert chat_lp.choices[0].logprobs is not None and chat_lp.choices[0].logprobs.content is not None
    want_lp = [(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in chat_lp.choices[0].logprobs.content]
    got_lp = [(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in part.logprobs]
    assert [(t, a) for t, _, a in got_lp] == [(t, a) for t, _, a in want_lp]
    assert all(abs(g - w) < 1e-4 for (_, g, _), (_, w, _) in zip(got_lp, want_lp))
    streamed = client.responses.create(model="default", input="hello", max_output_tokens=5, temperature=0,
                                       include=["message.output_text.logprobs"], top_logprobs=2, stream=True,
                                       extra_body={"ignore_eos": True})
    delta_lp = [lp.token for e in streamed if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert delta_lp == [t for t, _, _ in want_lp]

    # a stop string ends it: completed
    free = client.responses.create(model="default", input="hello", max_output_tokens=40, temperature=0,
                                   extra_body={"ignore_eos": True}).output_text
    stop = free[len(free) // 2:len(free) // 2 + 2]
    stopped = client.responses.create(model="default", input="hello", max_output_tokens=40, temperature=0,
                                      extra_body={"ignore_eos": True, "stop": [stop]})
    assert stopped.status == "completed" and stopped.incomplete_details is None, (seed, free, stop)
    assert stopped.output_text == free[:free.index(stop)]
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="default", input="x", tools=[{"type": "web_search"}])
    assert refused.value.body is not None and refused.value.body["param"] == "tools"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_123")

    body = {"model": "default", "input": "Once", "max_output_tokens": 1900, "ignore_eos": True, "stream": True}
    during, after = asyncio.run(_leave_mid_stream(tiny, "/v1/responses", body, rng.randint(5, 30)))
    assert during.num_requests == 1
    assert after.num_free_blocks == after.num_blocks and after.num_requests == 0


def test_fuzz_from_openapi_finds_no_server_error(tiny: Stack) -> None:
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    raw = httpx.get(f"{tiny.http_address()}/openapi.json").json()
    # Bound the work per example: a few tokens and choices each.
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        ref = raw["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        props = raw["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"]
        for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if name in props:
                props[name]["anyOf"][0]["maximum"] = 8  # the non-null branch of the generated schema
        if "n" in props:
            props["n"]["anyOf"][0]["maximum"] = 2
        props["model"] = {"type": "string", "enum": ["default", "model", "nope"]}
    schema = schemathesis.openapi.from_dict(raw)
    # schemathesis's own negative mode can spend minutes generating; arbitrary JSON bodies are
    # the bounded way to send malformed requests.
    json_values = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
        max_leaves=12,
    )
    endpoint = st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/responses"])
    junk = st.tuples(endpoint, st.dictionaries(st.sampled_from(PARAMS), json_values, max_size=6) | json_values)
    cases = st.one_of(schema.as_strategy(GenerationMode.POSITIVE), junk)
    statuses: list[int] = []

    @settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def check(case: Any) -> None:
        if isinstance(case, tuple):  # (path, arbitrary JSON body)
            path, body = case
            if isinstance(body, dict):
                body.setdefault("max_output_tokens" if path == "/v1/responses" else "max_tokens", 4)
            # json.dumps writes NaN and Infinity, which some clients send
            response = httpx.post(f"{tiny.http_address()}{path}", content=json.dumps(body), timeout=30,
                                  headers={"content-type": "application/json"})
            status, text = response.status_code, response.text
        else:
            path, body = case.path, case.body
            limits = ("max_tokens", "max_completion_tokens", "max_output_tokens")
            if isinstance(body, dict) and all(body.get(name) is None for name in limits):
                # chat's default is the whole context: seconds per example
                body["max_output_tokens" if path == "/v1/responses" else "max_tokens"] = 4
            answer = case.call(base_url=tiny.http_address(), timeout=30)
            status, text = answer.status_code, answer.text
        statuses.append(status)
        assert status < 500, (path, body, text)
        if status >= 400 and path.startswith("/v1/"):
            assert set(json.loads(text)["error"]) == {"message", "type", "param", "code"}

    check()
    assert 200 in statuses and any(400 <= s < 500 for s in statuses)


def test_200_concurrent_streaming_clients(tiny: Stack) -> None:
    async def one(http: httpx.AsyncClient, i: int) -> tuple[int, str, bool]:
        body = {"model": "default", "messages": [{"role": "user", "content": f"Count to {i}"}], "max_tokens": 8,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        text, done, status = "", False, 0
        async with http.stream("POST", f"{tiny.http_address()}/v1/chat/completions", json=body) as response:
            status = response.status_code
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    text += "".join(c["delta"].get("content", "") for c in chunk["choices"])
                    if not chunk["choices"]:
                        assert chunk["usage"]["completion_tokens"] == 8
        return status, text, done

    async def run() -> list[tuple[int, str, bool]]:
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            return await asyncio.gather(*(one(http, i) for i in range(200)))

    results = asyncio.run(run())
    assert [status for status, _, _ in results] == [200] * 200
    assert all(done and text for _, text, done in results)
    stats = asyncio.run(_wait_all_blocks_free(tiny, timeout_s=20))
    assert stats.num_free_blocks == TINY_BLOCKS and stats.num_requests == 0


def test_metrics_count_grpc_generate_too(tiny: Stack) -> None:
    from tandem.rpc.v1 import router_pb2, router_pb2_grpc

    before = tiny.metrics()

    async def generate() -> None:
        async with grpc.aio.insecure_channel(tiny.address("router")) as channel:
            request = router_pb2.GenerateRequest(text="Hi")
            request.sampling.max_tokens = 3
            responses = [r async for r in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=60)]
            assert responses[-1].usage.completion_tokens >= 1

    asyncio.run(generate())
    after = tiny.metrics()
    for name in ("tandem:request_success_total", "tandem:time_to_first_token_seconds_count",
                 "tandem:e2e_request_latency_seconds_count"):
        assert metric_value(after, name) == metric_value(before, name) + 1, name
    assert metric_value(after, "tandem:generation_tokens_total") > metric_value(before, "tandem:generation_tokens_total")
    assert 'finished_reason="length"' in after or 'finished_reason="stop"' in after
    assert metric_value(after, "tandem:num_requests_running") == 0
    assert metric_value(after, "tandem:num_requests_waiting") == 0
