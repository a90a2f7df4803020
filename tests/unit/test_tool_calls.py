"""Tool calling: the answer's ``<tool_call>`` blocks read out as they stream
(``tandem.engine.tool_calls``), a chat with tools and calls as a template renders it, and the
reading of ``tools`` / ``tool_choice`` with the grammars that force calls, walked through the batched Sampler over the default model's tokenizer."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer

from tandem.engine.errors import InvalidRequestError
from tandem.engine.grammar import Grammars
from tandem.engine.sampling import SamplingParams
from tandem.engine.tokenizer import Tokenizer
from router.core import tool_format_of
from tandem.engine.tool_calls import (
    MISTRAL_CALLS,
    PYTHON_TAG,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ToolAnswer,
    ToolCall,
    ToolCallParser,
    ToolFormat,
    ToolRequestError,
    ToolsAsked,
    chat_with_tools,
    check_tools,
    format_of_template,
    split_tool_calls,
    tool_call_parser,
    tools_asked,
)
from tests.unit.test_grammar import _walk

NAMES = frozenset({"get_weather", "add", "lookup-2"})
_args = st.dictionaries(st.text(alphabet="abxyz_é", min_size=1, max_size=5),
                        st.one_of(st.integers(-99, 99), st.text(alphabet="ab \"\\<>é", max_size=6), st.booleans(),
                                  st.none()), max_size=3)
# content that cannot hold a block's tags, with no whitespace at either end
_content = st.text(alphabet="ab <>/_{}\"é\n", min_size=1, max_size=12).map(str.strip).filter(
    lambda t: bool(t) and TOOL_CALL_OPEN not in t and "<tool_call" not in t[-12:])
_blank = st.text(alphabet=" \n\t", max_size=3)


@st.composite
def _answers(draw: st.DrawFn) -> tuple[str, str, list[ToolCall]]:
    """An answer's text of content, calls and broken blocks in random order, with what it
    should read as: its content (whitespace next to a call dropped) and its calls."""
    text = draw(_blank)
    runs, calls = [text], []  # runs: the text between calls
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["content", "call", "call", "unknown", "broken"]))
        if kind == "call":
            call = ToolCall(draw(st.sampled_from(sorted(NAMES))), json.dumps(draw(_args), ensure_ascii=False))
            body = json.dumps({"name": call.name, "arguments": json.loads(call.arguments)}, ensure_ascii=False,
                              indent=draw(st.sampled_from([None, 1])))
            text += f"{TOOL_CALL_OPEN}{draw(_blank)}{body}{draw(_blank)}{TOOL_CALL_CLOSE}"
            calls.append(call)
            runs.append("")
            piece = ""
        elif kind == "content":
            piece = draw(_content)
        elif kind == "unknown":  # a call of a tool that is not offered stays text
            piece = f'{TOOL_CALL_OPEN}{{"name": "rm", "arguments": {{}}}}{TOOL_CALL_CLOSE}'
        else:
            piece = f"{TOOL_CALL_OPEN}{{not json{TOOL_CALL_CLOSE}"
        piece += draw(_blank)
        text += piece
        runs[-1] += piece
    if not calls:
        return text, text, calls
    return text, runs[0].rstrip() + "".join(run.strip() for run in runs[1:]), calls


def _streamed(text: str, rng: random.Random, names: frozenset[str] | None = NAMES) -> tuple[str, list[ToolCall]]:
    parser, parts, at = ToolCallParser(names), [], 0
    while at < len(text):
        step = rng.randint(1, 9)
        parts += parser.feed(text[at:at + step])
        at += step
    parts += parser.finish()
    assert all(p for p in parts if isinstance(p, str)), parts  # no empty content pieces
    return "".join(p for p in parts if isinstance(p, str)), [p for p in parts if isinstance(p, ToolCall)]


@settings(max_examples=300, deadline=None)
@given(answer=_answers(), seed=st.integers(0, 2**31 - 1))
def test_blocks_read_as_calls_whether_whole_or_streamed_in_random_pieces(
        answer: tuple[str, str, list[ToolCall]], seed: int) -> None:
    text, content, calls = answer
    whole = split_tool_calls(text, NAMES)
    assert whole == (content, calls), text  # without calls: exactly as written
    assert _streamed(text, random.Random(seed)) == whole


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="<>_/tolcaé \n", max_size=40), seed=st.integers(0, 2**31 - 1))
def test_text_without_a_whole_block_is_content_exactly_as_written(text: str, seed: int) -> None:
    content, calls = split_tool_calls(text, NAMES)
    if TOOL_CALL_OPEN not in text:
        assert (content, calls) == (text, [])
    assert _streamed(text, random.Random(seed)) == (content, calls)


def test_an_unclosed_last_block_is_a_call_when_its_json_is_whole() -> None:
    whole = f'{TOOL_CALL_OPEN}\n{{"name": "add", "arguments": {{"a": 1}}}}\n'
    assert split_tool_calls(whole, NAMES) == ("", [ToolCall("add", '{"a": 1}')])
    cut = f'{TOOL_CALL_OPEN}\n{{"name": "add", "argu'
    assert split_tool_calls(cut, NAMES) == (cut, [])


def test_arguments_as_text_and_llama_parameters_are_read_and_max_calls_keeps_the_first() -> None:
    text = (f'{TOOL_CALL_OPEN}{{"name": "add", "arguments": "{{\\"a\\": 2}}"}}{TOOL_CALL_CLOSE}'
            f'{TOOL_CALL_OPEN}{{"name": "get_weather", "parameters": {{"city": "Oslo"}}}}{TOOL_CALL_CLOSE}')
    assert split_tool_calls(text, NAMES)[1] == [ToolCall("add", '{"a": 2}'), ToolCall("get_weather", '{"city": "Oslo"}')]
    assert split_tool_calls(text, NAMES, max_calls=1) == ("", [ToolCall("add", '{"a": 2}')])


# --- Llama 3's JSON and Mistral's [TOOL_CALLS]: the calls end the answer ------------------------------

def _call_text(fmt: ToolFormat, calls: list[ToolCall], draw: st.DrawFn) -> str:
    """``calls`` written as a model of ``fmt`` writes them (each spelling the format allows)."""
    key = "parameters" if fmt == "llama3_json" else "arguments"
    objects = [json.dumps({"name": c.name, key: json.loads(c.arguments)}, ensure_ascii=False,
                          indent=draw(st.sampled_from([None, 1]))) for c in calls]
    if fmt == "llama3_json":
        return draw(st.sampled_from(["", PYTHON_TAG])) + draw(st.sampled_from(["; ", ";", "\n"])).join(objects)
    spelling = draw(st.sampled_from(["list", "named", "bare"]))
    if spelling == "named":  # the later tokenizers' name[ARGS]{...}, each after its marker
        return "".join(f"{MISTRAL_CALLS}{c.name}[ARGS]{c.arguments}" for c in calls)
    if spelling == "bare":  # the same with both special tokens skipped from the text
        return "".join(f"{c.name}{c.arguments}" for c in calls)
    return draw(st.sampled_from(["", MISTRAL_CALLS])) + "[" + ", ".join(objects) + "]"


@st.composite
def _trailing_answers(draw: st.DrawFn, fmt: ToolFormat) -> tuple[str, str, list[ToolCall]]:
    """An answer of ``fmt``: whitespace, maybe content, then maybe calls (some not well formed, or
    of a tool not offered), with what it should read as."""
    marker = PYTHON_TAG if fmt == "llama3_json" else MISTRAL_CALLS
    opening = "{" if fmt == "llama3_json" else "["
    head = draw(_blank) + draw(st.one_of(st.just(""), _content.filter(
        lambda t: not t.startswith(opening) and marker[:4] not in t)))
    kind = draw(st.sampled_from(["none", "calls", "calls", "unknown", "cut"]))
    if kind == "none":
        return head, head, []
    calls = [ToolCall(draw(st.sampled_from(sorted(NAMES))), json.dumps(draw(_args), ensure_ascii=False))
             for _ in range(draw(st.integers(1, 3)))]
    if kind == "unknown":
        calls.append(ToolCall("rm", "{}"))
    written = _call_text(fmt, calls, draw)
    if head.strip():  # after content, the calls need their marker
        written = marker + written.removeprefix(marker)
    if kind == "cut":  # inside the first call, so that no whole call is left
        written = written[:draw(st.integers(1, max(1, len(written.split("}")[0]))))]
    text = head + draw(_blank) + written + draw(_blank)
    if kind != "calls":
        return text, text, []
    return text, head.rstrip(), calls


def _streamed_as(fmt: ToolFormat, text: str, rng: random.Random,
                 max_calls: int | None = None) -> tuple[str, list[ToolCall]]:
    parser, parts, at = tool_call_parser(fmt, NAMES, max_calls), [], 0
    while at < len(text):
        step = rng.randint(1, 9)
        parts += parser.feed(text[at:at + step])
        at += step
    parts += parser.finish()
    assert all(p for p in parts if isinstance(p, str)), parts
    return "".join(p for p in parts if isinstance(p, str)), [p for p in parts if isinstance(p, ToolCall)]


@pytest.mark.parametrize("fmt", ["llama3_json", "mistral"])
@settings(max_examples=300, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**31 - 1))
def test_trailing_calls_read_whether_whole_or_streamed_and_anything_else_is_content_as_written(
        fmt: ToolFormat, data: st.DataObject, seed: int) -> None:
    text, content, calls = data.draw(_trailing_answers(fmt))
    whole = split_tool_calls(text, NAMES, fmt=fmt)
    assert whole == (content, calls), text
    assert _streamed_as(fmt, text, random.Random(seed)) == whole
    if calls:
        assert split_tool_calls(text, NAMES, max_calls=1, fmt=fmt) == (content, calls[:1])


@pytest.mark.parametrize("fmt", ["llama3_json", "mistral"])
@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="[]{}\"<|_>;TOLCS:ae \n", max_size=40), seed=st.integers(0, 2**31 - 1))
def test_any_text_streamed_reads_as_it_does_whole(fmt: ToolFormat, text: str, seed: int) -> None:
    whole = split_tool_calls(text, NAMES, fmt=fmt)
    assert _streamed_as(fmt, text, random.Random(seed)) == whole
    if not whole[1]:
        assert whole[0] == text


def test_content_streams_before_the_calls_and_is_held_only_where_they_may_begin() -> None:
    parser = tool_call_parser("mistral", NAMES)
    assert parser.feed("It is sunny. [TOOL") == ["It is sunny."]  # the marker's start is held
    assert parser.feed('_CALLS][{"name": "add", "arguments": {"a": 1}}]') == []
    assert parser.finish() == [ToolCall("add", '{"a": 1}')]
    bare = tool_call_parser("mistral", NAMES)  # [TOOL_CALLS] and [ARGS] skipped: a tool's name opens it
    assert bare.feed("ad") == [] and bare.feed('d{"a": 1}') == [] and bare.finish() == [ToolCall("add", '{"a": 1}')]
    worded = tool_call_parser("mistral", NAMES)
    assert worded.feed("ad") == [] and worded.feed("d it up") == ["add it up"]
    llama = tool_call_parser("llama3_json", NAMES)
    assert llama.feed("  {") == [] and llama.feed('"name": "add"}') == []  # an answer opening a JSON object
    assert llama.finish() == [ToolCall("add", "{}")]
    prose = tool_call_parser("llama3_json", NAMES)
    assert prose.feed("Use {braces}") == ["Use {braces}"] and prose.finish() == []


@pytest.mark.parametrize(("source", "fmt"), [
    ("{{ '<tool_call>' }}{% for t in tools %}{{ t | tojson }}{% endfor %}", "hermes"),
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", "mistral"),
    ("{% for t in tools %}{{ t | tojson }}{% endfor %}{% if m.role == 'ipython' %}<|python_tag|>{% endif %}",
     "llama3_json"),
    ("{% for t in tools %}{{ t.function.name }}{% endfor %}", "hermes"),
])
def test_a_template_names_the_format_of_its_calls(source: str, fmt: ToolFormat, smollm2_dir: Path) -> None:
    assert format_of_template(source) == fmt
    tok = Tokenizer(BackendTokenizer.from_file(str(smollm2_dir / "tokenizer.json")), chat_template=source)
    assert tool_format_of(tok) == fmt
    assert tool_format_of(tok, "mistral") == "mistral"  # --tool-call-parser wins for a template with tools
    # SmolLM2's template does not render tools: it is told Hermes' format whatever the flag says
    assert tool_format_of(Tokenizer.from_dir(smollm2_dir), "llama3_json") == "hermes"


# --- the chat a template renders ------------------------------------------------------------

TOOLS = check_tools([
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                       "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                      "required": ["city"]}}},
    {"type": "function", "function": {"name": "add"}},
])


def _history(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "Weather in Oslo, and 2 + 3?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": f"call_{i}", "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for i, c in enumerate(calls)]},
            *({"role": "tool", "tool_call_id": f"call_{i}", "content": f"result {i}"} for i in range(len(calls)))]


@settings(max_examples=50, deadline=None)
@given(calls=st.lists(st.builds(lambda name, args: ToolCall(name, json.dumps(args, ensure_ascii=False)),
                                st.sampled_from(["get_weather", "add"]), _args), min_size=1, max_size=3),
       system=st.booleans())
def test_without_template_support_tools_are_told_and_calls_written_as_the_parser_reads_them(
        calls: list[ToolCall], system: bool) -> None:
    history = ([{"role": "system", "content": "Be brief."}] if system else []) + _history(calls)
    chat, tools = chat_with_tools(history, TOOLS, native=False)
    assert tools is None
    assert chat[0]["role"] == "system" and '"name": "get_weather"' in chat[0]["content"]
    assert chat[0]["content"].startswith("Be brief.") == system
    assistant = chat[2 if not system else 2]
    assert assistant["role"] == "assistant" and "tool_calls" not in assistant
    assert split_tool_calls(assistant["content"], frozenset({"get_weather", "add"})) == ("", calls)
    answers = [m for m in chat if m["content"].startswith("<tool_response>")]
    assert [m["role"] for m in answers] == ["user"] * len(calls)


def test_a_template_that_renders_tools_gets_them_and_calls_with_object_arguments(
        tmp_path: Path, smollm2_dir: Path) -> None:
    template = ("{% for t in tools %}T:{{ t.function.name }};{% endfor %}"
                "{% for m in messages %}{{ m.role }}:{{ m.content }}"
                "{% for c in m.tool_calls or [] %}C:{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}"
                "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}|{% endfor %}")
    tok = Tokenizer(BackendTokenizer.from_file(str(smollm2_dir / "tokenizer.json")), chat_template=template)
    assert tok.renders_tools()
    assert not Tokenizer.from_dir(smollm2_dir).renders_tools()
    chat, tools = chat_with_tools(_history([ToolCall("get_weather", '{"city": "Oslo"}')]), TOOLS, native=True)
    assert tok.apply_chat_template(chat, tools=tools, add_generation_prompt=False) == (
        "T:get_weather;T:add;user:Weather in Oslo, and 2 + 3?|assistant:C:get_weather(Oslo)|tool:result 0#call_0|")


@pytest.mark.parametrize(("tools", "words"), [
    ([], "non-empty list"),
    ([{"type": "retrieval"}], "function tools"),
    ([{"type": "function", "function": {"name": "a b"}}], "letters, digits"),
    ([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}], "two tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "JSON schema object"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], "description"),
])
def test_malformed_tools_are_refused_naming_what_is_wrong(tools: Any, words: str) -> None:
    with pytest.raises(InvalidRequestError, match=words):
        check_tools(tools)


# --- what the router reads, and the grammars that force calls ----------------------------------------

@pytest.mark.parametrize(("body", "param", "words"), [
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "always"}, "tool_choice", "required"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "not among"),
    ({"functions": [{"name": "f"}]}, "functions", "send tools"),
    ({"tools": "f"}, "tools", "list"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "parallel_tool_calls": "no"},
     "parallel_tool_calls", "true or false"),
])
def test_the_router_refuses_bad_tool_parameters_naming_them(body: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(ToolRequestError, match=words) as caught:
        tools_asked(body)
    assert caught.value.param == param


def test_no_tools_or_tool_choice_none_asks_for_nothing_and_auto_is_the_default() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert tools_asked({}) is None and tools_asked({"tool_choice": "auto"}) is None
    assert tools_asked({"tools": tools, "tool_choice": "none"}) is None
    asked = tools_asked({"tools": tools, "parallel_tool_calls": False})
    assert asked is not None and (asked.mode, asked.parallel, asked.grammar()) == ("auto", False, "")


@pytest.fixture(scope="module")
def grammars(smollm2_dir: Path) -> Grammars:
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    return Grammars.for_model_dir(smollm2_dir, tokenizer.vocab_size, tokenizer.eos_token_ids)


_bounded = st.dictionaries(st.text(alphabet="abc_", min_size=1, max_size=4), st.one_of(
    st.just({"type": "boolean"}), st.integers(0, 9).map(lambda n: {"type": "string", "maxLength": n}),
    st.tuples(st.integers(-9, 9), st.integers(0, 99)).map(lambda t: {"type": "integer", "minimum": t[0],
                                                                     "maximum": t[0] + t[1]})),
    max_size=3).map(lambda props: {"type": "object", "properties": props, "required": sorted(props),
                                   "additionalProperties": False})


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schemas=st.lists(_bounded, min_size=1, max_size=3), parallel=st.booleans(),
       named=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_forced_calls_walked_by_random_logits_name_a_tool_and_keep_to_its_schema(
        grammars: Grammars, smollm2_dir: Path, schemas: list[dict[str, Any]], parallel: bool, named: bool,
        seed: int) -> None:
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    tools = check_tools([{"type": "function", "function": {"name": f"f{i}", "parameters": s}}
                         for i, s in enumerate(schemas)])
    choice: Any = {"type": "function", "function": {"name": "f0"}} if named else "required"
    asked = tools_asked({"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel})
    assert isinstance(asked, ToolsAsked)
    eos = tokenizer.eos_token_ids
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=1500, grammar=asked.grammar())]
    [output] = _walk(grammars, params, eos, seed, steps=1500)
    assert output[-1] in eos, tokenizer.decode(output)
    text = tokenizer.decode(output[:-1])
    whole = ToolAnswer(asked)
    content, calls = whole.feed(text, last=True)
    assert content == "" and calls and all(c.id and c.id.startswith("call_") for c in calls), text
    assert whole.ends_in_calls("stop") != named
    assert named or parallel or len(calls) == 1
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), schemas[int((call.name or "f0")[1:])])
    # streamed in pieces: the same calls (a named call's arguments come piece by piece)
    rng, streamed, at = random.Random(seed), ToolAnswer(asked), 0
    pieces = []
    while at < len(text) or not pieces:
        step = rng.randint(1, 6)
        pieces.append(streamed.feed(text[at:at + step], last=at + step >= len(text)))
        at += step
    got = [c for _, cs in pieces for c in cs]
    assert "".join(c for c, _ in pieces) == ""
    assert [c.name for c in got if c.name] == [c.name for c in calls]
    assert "".join(c.arguments for c in got) == "".join(c.arguments for c in calls)
