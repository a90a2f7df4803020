"""Tool calls in the formats of models whose chat templates render tools (Llama 3's JSON, Mistral's
``[TOOL_CALLS]``), read by the router as the template (or ``--tool-call-parser``) says, through
the openai client and the gRPC SDK, on a stack of random weights with a template of that kind."""

from __future__ import annotations

import json
import random
import re
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai

from tandem.client import TandemClient
from tests.integration.stack import Stack, write_tiny_chat_model

# A template in the manner of Llama 3.1's (written for this test): the tools in a system turn
# that asks for a JSON object with "parameters", calls rendered so, tool answers in ipython turns.
LLAMA_STYLE_TEMPLATE = (
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nTo call a function, answer with the JSON "
    '{"name": function name, "parameters": its arguments}. The functions:\n'
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{% elif m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for c in m.tool_calls %}{{ {'name': c.function.name, 'parameters': c.function.arguments} | tojson }}"
    "{% endfor %}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}},
]
HELLO: list[Any] = [{"role": "user", "content": "Weather in Oslo, and what is 2 + 3?"}]


def _held(client: openai.OpenAI, regex: str, stream: bool = False) -> tuple[str | None, list[tuple[str, Any]], str]:
    """The content, calls (name, arguments) and finish reason of an auto-mode answer held to
    ``regex``, whole or gathered from its stream."""
    body: dict[str, Any] = {"model": "default", "messages": HELLO, "max_tokens": 120, "temperature": 1.0,
                            "tools": TOOLS, "extra_body": {"structured_outputs": {"regex": regex}}}
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        return (choice.message.content, [(c.function.name, json.loads(c.function.arguments))
                                         for c in choice.message.tool_calls or []], str(choice.finish_reason))
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    finish = ""
    for chunk in client.chat.completions.create(**body, stream=True):
        for c in chunk.choices:
            content.append(c.delta.content or "")
            for piece in c.delta.tool_calls or []:
                assert piece.function is not None
                if piece.id is not None:
                    assert piece.type == "function" and piece.function.name
                    calls[piece.index] = [piece.function.name, ""]
                calls[piece.index][1] += piece.function.arguments or ""
            finish = c.finish_reason or finish
    return "".join(content) or None, [(name, json.loads(args)) for name, args in calls.values()], finish


def _calls_regex(calls: list[tuple[str, dict[str, Any]]], fmt: str) -> str:
    if fmt == "llama3_json":
        return re.escape("; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls))
    return re.escape("[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls]))


def test_llama3_json_calls_by_the_template_and_mistral_by_the_flag(smollm2_dir: Path, tmp_path: Path) -> None:
    model = write_tiny_chat_model(tmp_path / "model", smollm2_dir)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = LLAMA_STYLE_TEMPLATE
    config_path.write_text(json.dumps(config))
    (tmp_path / "logs").mkdir()
    rng = random.Random()
    seed = rng.randrange(10**6)
    rng.seed(seed)
    with Stack(model, tmp_path / "logs", num_blocks=1024,
               extra_env={"TANDEM_CELL_ID": f"oa-fmt-{uuid.uuid4().hex[:6]}"}) as stack:
        for fmt in ("llama3_json", "mistral"):
            if fmt == "mistral":  # the router again, told the format: --tool-call-parser's TANDEM_ twin
                stack.kill("router")
                stack.extra_env["TANDEM_TOOL_CALL_PARSER"] = "mistral"
                stack.start_process("router")
            client = openai.OpenAI(base_url=f"{stack.http_address()}/v1", api_key="unused", max_retries=0,
                                   timeout=60)
            calls = [(rng.choice(["get_weather", "add"]), {"a": rng.randint(0, 99)})
                     for _ in range(rng.randint(1, 3))]
            regex = _calls_regex(calls, fmt)
            for stream in (False, True):
                assert _held(client, regex, stream) == (None, calls, "tool_calls"), (seed, fmt, stream)
                # prose, then the calls after their marker (Llama's <|python_tag|> is plain text to
                # this tokenizer, as it would be kept with skip_special_tokens false)
                marker = "<|python_tag|>" if fmt == "llama3_json" else ""
                prose = rng.choice(["Let me check.", "Sure: {one} moment"])
                assert _held(client, re.escape(prose + " " + marker) + regex, stream) == (
                    prose, calls, "tool_calls"), (seed, fmt, stream)
                # not calls of an offered tool: the answer is content, as written
                unknown = _calls_regex([("rm", {"path": "/"})], fmt)
                content, made, finish = _held(client, unknown, stream)
                assert (made, finish) == ([], "stop") and content is not None and '"rm"' in content, seed

            with TandemClient(stack.address("router"), timeout_s=60, max_retries=0) as sdk:
                got = sdk.chat(HELLO, max_tokens=120, temperature=1.0, tools=TOOLS,
                               structured_outputs={"regex": regex})
                assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == calls, seed
                assert got.finish_reason == "tool_calls" and not got.text
                streamed = [c for chunk in sdk.chat_stream(HELLO, max_tokens=120, temperature=1.0, tools=TOOLS,
                                                           structured_outputs={"regex": regex})
                            for c in chunk.tool_calls]
                assert [(c.name, json.loads(c.arguments)) for c in streamed] == calls, seed

        # the template renders earlier calls its own way, with object arguments
        history: list[Any] = [*HELLO, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
        base = stack.http_address()
        tokens = httpx.post(f"{base}/tokenize", json={"messages": history, "tools": TOOLS}, timeout=30).json()["tokens"]
        text = httpx.post(f"{base}/detokenize", json={"tokens": tokens}, timeout=30).json()["prompt"]
        assert '{"name": "add", "parameters": {"a": 2, "b": 3}}' in text and "ipython<|end_header_id|>\n\n5" in text
