"""Tokenizer, chat template rendering and incremental detokenization on tiny in-test tokenizers."""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as BackendTokenizer

from tandem.engine.errors import InvalidRequestError, ModelLoadError
from tandem.engine.tokenizer import IncrementalDetokenizer, Tokenizer, check_template_variables

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# English only, so that accented letters, CJK and emoji stay split into single-byte tokens.
CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "a small tokenizer for tests; it knows common english words and spaces.",
] * 20

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_byte_level_backend(bos_post_processor: bool = False) -> BackendTokenizer:
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    if bos_post_processor:
        backend.post_processor = processors.TemplateProcessing(
            single="<|im_start|> $A", special_tokens=[("<|im_start|>", backend.token_to_id("<|im_start|>"))]
        )
    return backend


def write_model_dir(
    root: Path,
    backend: BackendTokenizer,
    chat_template: str | list[dict[str, str]] | None = CHATML,
    generation_eos: Any = None,
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    backend.save(str(root / "tokenizer.json"))
    config: dict[str, Any] = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    if generation_eos is not None:
        (root / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return root


@pytest.fixture(scope="module")
def backend() -> BackendTokenizer:
    return build_byte_level_backend()


@pytest.fixture()
def tokenizer(tmp_path: Path, backend: BackendTokenizer) -> Tokenizer:
    return Tokenizer.from_dir(write_model_dir(tmp_path / "model", backend))


def with_template(tmp_path: Path, backend: BackendTokenizer, template: str) -> Tokenizer:
    return Tokenizer.from_dir(write_model_dir(tmp_path / "templated", backend, chat_template=template))


# --- loading ---------------------------------------------------------------------------------


def test_from_dir_reads_special_tokens_and_eos_union(tmp_path: Path, backend: BackendTokenizer) -> None:
    end_of_text = backend.token_to_id("<|endoftext|>")
    im_end = backend.token_to_id("<|im_end|>")
    tok = Tokenizer.from_dir(write_model_dir(tmp_path / "m", backend, generation_eos=[end_of_text]))
    assert tok.bos_token_id == backend.token_to_id("<|im_start|>")
    # generation_config's eos first, then tokenizer_config's eos_token, without duplicates
    assert tok.eos_token_ids == (end_of_text, im_end)
    assert tok.vocab_size == backend.get_vocab_size(with_added_tokens=True)


def test_eos_from_config_json_when_no_generation_config(tmp_path: Path, backend: BackendTokenizer) -> None:
    root = write_model_dir(tmp_path / "m", backend)
    (root / "config.json").write_text(json.dumps({"eos_token_id": 0}))
    assert Tokenizer.from_dir(root).eos_token_ids == (0, backend.token_to_id("<|im_end|>"))


def test_missing_tokenizer_json_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_chat_template_jinja_file_is_used_when_config_has_none(tmp_path: Path, backend: BackendTokenizer) -> None:
    root = write_model_dir(tmp_path / "m", backend, chat_template=None)
    (root / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert Tokenizer.from_dir(root).apply_chat_template([{"role": "user", "content": "hey"}]) == "hey!"


# --- encode / decode -------------------------------------------------------------------------


def test_encode_decode_round_trip_and_special_tokens(tokenizer: Tokenizer) -> None:
    text = "hello world, héllo wörld 你好 👋"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    with_specials = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert with_specials[0] == tokenizer.token_to_id("<|im_start|>")
    assert with_specials[-1] == tokenizer.token_to_id("<|im_end|>")
    assert tokenizer.decode(with_specials) == "user\nhi"
    assert tokenizer.decode(with_specials, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_encode_chat_does_not_add_post_processor_tokens(tmp_path: Path) -> None:
    backend = build_byte_level_backend(bos_post_processor=True)
    bos_template = "{{ bos_token }}" + CHATML
    tok = Tokenizer.from_dir(write_model_dir(tmp_path / "m", backend, chat_template=bos_template))
    bos = tok.token_to_id("<|im_start|>")
    assert tok.encode("hello")[0] == bos  # the post-processor adds a BOS to plain text ...
    ids = tok.encode_chat([{"role": "user", "content": "hello"}])
    # ... but the template already wrote one: exactly one BOS before the first <|im_start|>user
    assert ids[:2] == [bos, bos]
    assert ids == tok.encode(tok.apply_chat_template([{"role": "user", "content": "hello"}]), add_special_tokens=False)


# --- chat templates --------------------------------------------------------------------------


def test_chatml_rendering_matches_hand_written_string(tokenizer: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "bye"},
    ]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nbye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tokenizer.apply_chat_template(messages) == expected
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False) == expected.removesuffix(
        "<|im_start|>assistant\n"
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=4),
       final=st.text(min_size=1, max_size=24).filter(str.strip))
def test_continue_final_message_ends_the_prompt_with_its_text(tokenizer: Tokenizer, turns: list[str],
                                                             final: str) -> None:
    roles = ["user", "assistant"]
    messages = [{"role": roles[i % 2], "content": text} for i, text in enumerate(turns)]
    messages.append({"role": "assistant", "content": final})
    closed = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    continued = tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    # the whole conversation up to the final text, and not its end-of-turn
    assert continued == closed.removesuffix("<|im_end|>\n")
    assert continued.endswith(final) and closed.startswith(continued)
    ids = tokenizer.encode_chat(messages, add_generation_prompt=False, continue_final_message=True)
    assert ids == tokenizer.encode(continued, add_special_tokens=False)


def test_continue_final_message_on_a_template_that_strips_text(tmp_path: Path, backend: BackendTokenizer) -> None:
    tok = with_template(tmp_path, backend, "{% for m in messages %}[{{ m.role }}] {{ m.content | trim }} END\n"
                                           "{% endfor %}")
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  the answer is  "}]
    # the text as the template writes it (leading spaces trimmed), up to where the client's ended
    assert tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True) == (
        "[user] q END\n[assistant] the answer is  ")
    # a template that writes the text as JSON: continued inside the string
    quoting = with_template(tmp_path / "json", backend, "{% for m in messages %}{{ m.role }}={{ m.content | tojson }};"
                                                       "{% endfor %}")
    assert quoting.apply_chat_template([{"role": "assistant", "content": 'say "hi'}], add_generation_prompt=False,
                                       continue_final_message=True) == 'assistant="say \\"hi'
    # a template that leaves the text out cannot be continued
    blind = with_template(tmp_path / "blind", backend, "{% for m in messages %}[{{ m.role }}]{% endfor %}")
    with pytest.raises(InvalidRequestError, match="cannot be continued"):
        blind.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)


@pytest.mark.parametrize("kwargs, match", [
    ({"continue_final_message": True}, "exclude each other"),
    ({"add_generation_prompt": False, "continue_final_message": True, "final": "   "}, "text to continue"),
])
def test_chat_options_that_cannot_render_are_refused(tokenizer: Tokenizer, kwargs: dict[str, Any],
                                                     match: str) -> None:
    final = kwargs.pop("final", "an answer")
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": final}]
    with pytest.raises(InvalidRequestError, match=match):
        tokenizer.apply_chat_template(messages, **kwargs)


def test_template_variables_may_not_take_an_arguments_place(tokenizer: Tokenizer) -> None:
    for names in (["messages"], ["self", "tools"], ["add_generation_prompt", "x"], ["continue_final_message"]):
        with pytest.raises(InvalidRequestError, match="may not set"):
            check_template_variables(dict.fromkeys(names, 1))
    variables: dict[str, Any] = {"enable_thinking": False, "documents": [], "bos_token": "B"}
    check_template_variables(variables)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "q"}], **variables).startswith("<|im_start|>")


def test_trim_blocks_lstrip_blocks_and_special_token_variables(tmp_path: Path, backend: BackendTokenizer) -> None:
    # Block tags on their own lines leave no newline or indentation behind (trim/lstrip_blocks).
    template = (
        "{{ bos_token }}\n"
        "{% for message in messages %}\n"
        "    {% if message.role == 'user' %}\n"
        "U: {{ message.content }}\n"
        "    {% else %}\n"
        "A: {{ message.content }}{{ eos_token }}\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
    )
    tok = with_template(tmp_path, backend, template)
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], add_generation_prompt=False
    )
    assert rendered == "<|im_start|>\nU: q\nA: a<|im_end|>\n"


def test_template_features_hf_templates_use(tmp_path: Path, backend: BackendTokenizer) -> None:
    template = (
        "{% set ns = namespace(count=0, system='') %}"
        "{% for m in messages %}{% set ns.count = ns.count + 1 %}"
        "{% if m.role == 'system' %}{% set ns.system = m['content'] %}{% endif %}"
        "{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}"
        "[{{ ns.count }}|{{ ns.system }}|{{ messages | length }}]"
        "{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}"
        "{{ {'b': 1, 'a': '<é>'} | tojson(indent=2, sort_keys=true) }}"
        "{% generation %}<{{ messages[-1].get('content') }}>{% endgeneration %}"
        "{{ dict(x=1)['x'] }}"
        "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}"
        "{{ strftime_now('%Y') }}"
    )
    tok = with_template(tmp_path, backend, template)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "x < y & z"}}]
    rendered = tok.apply_chat_template(
        [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "one"},
            {"role": "user", "content": "two"},
            {"role": "user", "content": "three"},
        ],
        tools=tools,
        enable_thinking=False,
    )
    expected = (
        "[3|sys|4]"
        # HF's tojson: no HTML escaping, non-ASCII kept, indent/sort_keys honoured
        '{"type": "function", "function": {"name": "get_weather", "description": "x < y & z"}}'
        '{\n  "a": "<é>",\n  "b": 1\n}'
        "<three>"
        "1"
        "/no_think"
        f"{datetime.now().year}"
    )
    assert rendered == expected


def test_reasoning_content_is_aliased_to_thinking(tmp_path: Path, backend: BackendTokenizer) -> None:
    tok = with_template(
        tmp_path, backend, "{% for m in messages %}{{ m.thinking }}/{{ m.reasoning_content }}{% endfor %}"
    )
    message = {"role": "assistant", "content": "ok", "reasoning": "because"}
    assert tok.apply_chat_template([message]) == "because/because"
    assert "thinking" not in message  # the caller's message is not modified


def test_raise_exception_becomes_invalid_request(tmp_path: Path, backend: BackendTokenizer) -> None:
    tok = with_template(
        tmp_path,
        backend,
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}ok",
    )
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(InvalidRequestError, match="Conversation must start with user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_sandbox_forbids_mutating_messages(tmp_path: Path, backend: BackendTokenizer) -> None:
    tok = with_template(tmp_path, backend, "{% set _ = messages.append({'role': 'user'}) %}x")
    with pytest.raises(InvalidRequestError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_named_templates_pick_tool_use_when_tools_given(tmp_path: Path, backend: BackendTokenizer) -> None:
    templates = [
        {"name": "default", "template": "plain"},
        {"name": "tool_use", "template": "tools:{{ tools | length }}"},
    ]
    tok = Tokenizer.from_dir(write_model_dir(tmp_path / "m", backend, chat_template=templates))
    message = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(message) == "plain"
    assert tok.apply_chat_template(message, tools=[{"type": "function"}]) == "tools:1"


def test_model_without_chat_template(tmp_path: Path, backend: BackendTokenizer) -> None:
    tok = Tokenizer.from_dir(write_model_dir(tmp_path / "m", backend, chat_template=None))
    assert not tok.has_chat_template
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ("hello", "messages must be a list"),
        ([], "messages must not be empty"),
        ([{"role": "user", "content": "ok"}, "text"], "messages[1] must be an object"),
        ([{"content": "x"}], "messages[0].role"),
        ([{"role": "", "content": "x"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content must be a string, got missing"),
        (
            [{"role": "user", "content": "a"}, {"role": "user", "content": 3}],
            "messages[1].content must be a string, got int",
        ),
    ],
)
def test_invalid_messages_name_the_bad_field(tokenizer: Tokenizer, messages: Any, field: str) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(field)):
        tokenizer.apply_chat_template(messages)


def test_assistant_tool_call_without_content_is_accepted(tmp_path: Path, backend: BackendTokenizer) -> None:
    tok = with_template(tmp_path, backend, "{% for m in messages %}{{ m.role }}{% endfor %}")
    call = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}
    assert tok.apply_chat_template([{"role": "user", "content": "x"}, call]) == "userassistant"


def test_invalid_tools_rejected(tokenizer: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError, match="tools"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=["not a schema"])  # type: ignore[list-item]


# --- incremental detokenization --------------------------------------------------------------


def stream(tok: Tokenizer, ids: list[int], prompt_ids: list[int] | None = None) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt_ids or [])
    pieces = [detok.step(token_id) for token_id in ids]
    pieces.append(detok.flush())
    return pieces


def test_detokenizer_holds_split_multibyte_characters(tokenizer: Tokenizer) -> None:
    text = "héllo wörld 你好 👋 done"
    ids = tokenizer.encode(text)
    # The test only means something if some tokens really are partial UTF-8 sequences.
    assert any("\ufffd" in tokenizer.decode([token_id]) for token_id in ids)
    pieces = stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in piece for piece in pieces)
    assert {"你", "好", "👋", "é", "ö"} <= set(pieces)  # each character emitted once it completes


def test_detokenizer_skips_special_tokens_and_flushes(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("the fox<|im_end|>")
    pieces = stream(tokenizer, ids)
    assert "".join(pieces) == "the fox"
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(detok.step(i) for i in ids) + detok.flush() == "the fox<|im_end|>"


def test_detokenizer_holds_a_character_until_its_last_byte(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 👋")
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.step(i) for i in ids[:-1]) == "ok "  # the emoji's first bytes are held back
    assert detok.step(ids[-1]) == "👋"
    assert detok.flush() == ""


def test_detokenizer_flush_releases_what_is_held(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 👋")
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.step(i) for i in ids[:-1]) == "ok "
    # Generation stopped mid-character: flush hands over the remainder rather than losing it.
    assert detok.flush() == tokenizer.decode(ids[:-1])[len("ok ") :]
    assert detok.flush() == ""


def test_detokenizer_after_a_prompt_that_ends_mid_character(tokenizer: Tokenizer) -> None:
    prompt_ids = tokenizer.encode("ok 👋")[:-1]  # the emoji's first bytes only
    assert tokenizer.decode(prompt_ids).endswith("\ufffd")
    ids = tokenizer.encode(" and more: 你好")
    assert "".join(stream(tokenizer, ids, prompt_ids)) == tokenizer.decode(ids)  # no prompt bytes leak out


def test_detokenizer_with_context_dependent_decoder(tmp_path: Path) -> None:
    # SentencePiece-style: a token's leading "▁" is a space except at the start of the text,
    # so decoding one token alone would drop spaces between words.
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3, "▁ça": 4, "▁va": 5}
    backend = BackendTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    backend.add_special_tokens([AddedToken("</s>", special=True)])
    tok = Tokenizer.from_dir(write_model_dir(tmp_path / "spm", backend, chat_template=None))
    assert tok.decode([2]) == "world"  # alone, the space is lost

    generated = [2, 3, 4, 5]
    pieces = stream(tok, generated, prompt_ids=[1])
    assert pieces[0] == " world"
    assert "".join(pieces) == " world! ça va"
    # Without a prompt the first token starts the text, exactly as a full decode does.
    assert "".join(stream(tok, generated)) == tok.decode(generated) == "world! ça va"
