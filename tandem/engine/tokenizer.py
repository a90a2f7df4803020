"""Tokenizer and chat template for a Hugging Face style model directory, without transformers.

``Tokenizer`` wraps a ``tokenizers.Tokenizer`` (``tokenizer.json``) and renders chat templates
with jinja2 the way transformers' ``apply_chat_template`` does, so that the prompt ids Tandem
serves are the ids the model was trained on. ``IncrementalDetokenizer`` turns a stream of
generated ids into a stream of text without ever emitting half a character.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.decoders import DecodeStream
from tokenizers.pre_tokenizers import ByteLevel

from tandem.engine.errors import InvalidRequestError, ModelLoadError

# Names a message's reasoning travels under; transformers fills in the first two from any of
# them so that templates reading either find it.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
# How many times a normalizer can shrink text's UTF-8 bytes, measured over every code point:
# NFKC/NFKD at most 4x (U+107A5 MODIFIER LETTER SMALL Q, 4 bytes, becomes "q"), NFC/NFD 3x (as
# do Hangul jamo composed: 9 bytes into one 3-byte syllable), Lowercase 3x (KELVIN SIGN to "k").
_NORMALIZER_SHRINK = {"NFC": 4, "NFD": 4, "NFKC": 4, "NFKD": 4, "Lowercase": 3, "Prepend": 1}
# Pre-tokenizers that split text without dropping any of it.
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split"})


class Tokenizer:
    """Text <-> ids for one model, plus its chat template.

    Invariants: ``encode`` and ``decode`` are the ``tokenizers`` backend's, so they agree with
    transformers' fast tokenizer on the same ``tokenizer.json``; ``apply_chat_template``
    renders what transformers renders for the same template, messages and options.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        chat_template: str | Mapping[str, str] | None = None,
        special_tokens: Mapping[str, str] | None = None,
        eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
    ) -> None:
        self._backend = backend
        self._chat_template = chat_template
        self._special_tokens = dict(special_tokens or {})
        self._eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self._bos_token_id = bos_token_id

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` and the optional ``tokenizer_config.json``,
        ``chat_template.jinja``, ``generation_config.json`` and ``config.json`` of ``model_dir``.

        Eos ids are the union, in this order, of generation_config.json's (or else
        config.json's) ``eos_token_id`` and tokenizer_config.json's ``eos_token``: generation
        stops on any of them. Raises ModelLoadError when tokenizer.json is missing or invalid.
        """
        root = Path(model_dir)
        tokenizer_path = root / "tokenizer.json"
        if not tokenizer_path.is_file():
            raise ModelLoadError(f"model directory {root} has no tokenizer.json")
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_path))
        except Exception as exc:  # the Rust side raises a bare Exception for a bad file
            raise ModelLoadError(f"{tokenizer_path} is not a valid tokenizers file: {exc}") from None

        tokenizer_config = _read_json(root / "tokenizer_config.json")
        chat_template = _chat_template_from(tokenizer_config, root)
        special_tokens = {
            name: text for name in _SPECIAL_TOKEN_NAMES if (text := _token_text(tokenizer_config.get(name))) is not None
        }

        eos_ids: list[int] = []
        generation_eos = _read_json(root / "generation_config.json").get("eos_token_id")
        model_config = _read_json(root / "config.json")
        eos_ids += _as_id_list(generation_eos if generation_eos is not None else model_config.get("eos_token_id"))
        eos_text = special_tokens.get("eos_token")
        if eos_text is not None and (eos_id := backend.token_to_id(eos_text)) is not None:
            eos_ids.append(eos_id)

        bos_text = special_tokens.get("bos_token")
        bos_id = backend.token_to_id(bos_text) if bos_text is not None else None
        if bos_id is None and isinstance(model_config.get("bos_token_id"), int):
            bos_id = model_config["bos_token_id"]
        return cls(
            backend,
            chat_template=chat_template,
            special_tokens=special_tokens,
            eos_token_ids=eos_ids,
            bos_token_id=bos_id,
        )

    @property
    def backend(self) -> BackendTokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._backend

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation (document end and chat end-of-turn)."""
        return self._eos_token_ids

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        size: int = self._backend.get_vocab_size(with_added_tokens=True)
        return size

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    @cached_property
    def max_bytes_per_token(self) -> int | None:
        """An upper bound on how many UTF-8 bytes of input text one token stands for, or None
        when this tokenizer has none. Computed once from the vocabulary (~50 ms for 50k ids).

        The bound is on the bytes some token stands for (``kept_bytes``: a byte-level vocabulary
        may lack a byte's symbol, and that byte is then dropped; SmolLM2 drops "\x16"). It holds
        when every other input byte ends up in some token: a BPE model that is byte level or has
        byte fallback, pre-tokenizers that split without
        dropping text, and no added token that swallows whitespace. A token then stands for at
        most ``len(decode([id])) + 1`` bytes of the normalized text (the +1: a Metaspace token's
        leading space that decoding drops; a lone byte decodes to U+FFFD, 3 bytes, more than the
        one it covers), and the normalizer may first shrink the text by at most the factor in
        ``_NORMALIZER_SHRINK`` per step (a replacement by a string no shorter shrinks nothing).
        Anything else (WordPiece or Unigram unknown tokens that swallow a word, stripping,
        regex replacements, whitespace-dropping pre-tokenizers) has no bound: None.
        """
        config = json.loads(self._backend.to_str())
        model = config.get("model") or {}
        if model.get("type") != "BPE":
            return None
        shrink = _normalizer_shrink(config.get("normalizer"))
        pre_types = _pre_tokenizer_types(config.get("pre_tokenizer"))
        if shrink is None or pre_types is None:
            return None
        if not model.get("byte_fallback") and "ByteLevel" not in pre_types:
            return None
        if any(t.get("lstrip") or t.get("rstrip") for t in config.get("added_tokens") or ()):
            return None
        size = self._backend.get_vocab_size(with_added_tokens=True)
        decode = self._backend.decode
        longest = max((len(decode([i], skip_special_tokens=False).encode()) for i in range(size)), default=0)
        return (longest + 1) * shrink

    def max_text_bytes(self, num_tokens: int) -> int | None:
        """The most UTF-8 bytes a text encoding to at most ``num_tokens`` tokens can have
        (``num_tokens * max_bytes_per_token``), or None when there is no bound: a longer
        text cannot fit, and can be refused without being tokenized."""
        per_token = self.max_bytes_per_token
        return None if per_token is None else num_tokens * per_token

    @cached_property
    def _dropped_bytes(self) -> bytes:
        """The byte values a byte-level BPE without byte fallback drops: their symbols are not in
        its vocabulary (empty for every other tokenizer)."""
        config = json.loads(self._backend.to_str())
        model = config.get("model") or {}
        if model.get("type") != "BPE" or model.get("byte_fallback"):
            return b""
        if "ByteLevel" not in (_pre_tokenizer_types(config.get("pre_tokenizer")) or ()):
            return b""
        symbols = _byte_level_symbols()
        return bytes(sorted(b for b, symbol in symbols.items() if self._backend.token_to_id(symbol) is None))

    def kept_bytes(self, text: str) -> int:
        """The UTF-8 bytes of ``text`` that some token stands for: all but the ones this
        tokenizer drops (see ``max_bytes_per_token``)."""
        encoded = text.encode("utf-8", "surrogatepass")
        dropped = self._dropped_bytes
        return len(encoded.translate(None, dropped)) if dropped else len(encoded)

    def encode_releasing_gil(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``encode``, but the Rust side releases the GIL while it works (``encode`` holds it:
        a thread running a long one would stall the event loop just the same). For long
        texts, in a worker thread."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"text to encode must be a string, got {type(text).__name__}")
        ids: list[int] = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return ids

    def token_to_id(self, token: str) -> int | None:
        result: int | None = self._backend.token_to_id(token)
        return result

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids for ``text``; ``add_special_tokens`` applies tokenizer.json's post-processor
        (for example a BOS for Llama 3; nothing for SmolLM2)."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"text to encode must be a string, got {type(text).__name__}")
        ids: list[int] = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text: str = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        **extra: Any,
    ) -> str:
        """Render ``messages`` with the model's chat template, as transformers'
        ``apply_chat_template(..., tokenize=False)`` does.

        The template sees ``messages``, ``tools``, ``documents`` (from ``extra``, default None),
        ``add_generation_prompt``, the special token strings (``bos_token``, ``eos_token``, ...)
        and every key of ``extra`` (e.g. ``enable_thinking``), which overrides the token strings.
        With ``continue_final_message`` the text ends where the last message's content ends (its
        end-of-turn cut off), so that generation continues it; it excludes
        ``add_generation_prompt``. Raises InvalidRequestError for malformed messages or tools, for
        a model without a chat template, and when the template itself raises (``raise_exception``).
        """
        _validate_messages(messages)
        mark = ""
        if continue_final_message:
            if add_generation_prompt:
                raise InvalidRequestError("continue_final_message and add_generation_prompt exclude each other: "
                                          "set add_generation_prompt to false")
            final = messages[-1].get("content")
            if not isinstance(final, str) or not final.strip():
                raise InvalidRequestError("continue_final_message needs a last message with text to continue")
            # letters and digits only, so that it survives what templates do to text (trim, tojson)
            mark = f"tandemcontinue{secrets.token_hex(8)}"
            messages = [*messages[:-1], {**messages[-1], "content": final + mark}]
        if tools is not None:
            if not isinstance(tools, (list, tuple)) or not all(isinstance(t, Mapping) for t in tools):
                raise InvalidRequestError("tools must be a list of JSON-schema objects")
        template = self._select_template(tools)
        chat = [_with_reasoning_aliases(dict(message)) for message in messages]
        documents = extra.pop("documents", None)
        variables: dict[str, Any] = {**self._special_tokens, **extra}
        try:
            rendered: str = _compile_template(template).render(
                messages=chat,
                tools=[dict(t) for t in tools] if tools is not None else None,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"chat template rejected the request: {exc}") from None
        return _cut_at_mark(rendered, mark) if mark else rendered

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        **extra: Any,
    ) -> list[int]:
        """Prompt ids for a conversation: the rendered template encoded without adding special
        tokens, because the template already writes every special token it wants (this is what
        transformers' ``apply_chat_template(tokenize=True)`` does)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                        continue_final_message=continue_final_message, **extra)
        return self.encode(text, add_special_tokens=False)

    def renders_tools(self) -> bool:
        """Whether the chat template used with tools reads its ``tools`` variable (Qwen's,
        Hermes', Llama 3.1's do; SmolLM2's does not: a chat with tools then needs them told some
        other way, ``tandem.engine.tool_calls``). InvalidRequestError without a chat template."""
        return "tools" in _template_reads(self._select_template(tools=[]))

    def tools_template(self) -> str:
        """The source of the chat template used with tools; InvalidRequestError without one."""
        return self._select_template(tools=[])

    def _select_template(self, tools: Sequence[Mapping[str, Any]] | None) -> str:
        template = self._chat_template
        if template is None:
            raise InvalidRequestError("this model has no chat template; send a plain prompt instead of messages")
        if isinstance(template, str):
            return template
        # Named templates: transformers picks "tool_use" when tools are given and it exists.
        if tools is not None and "tool_use" in template:
            return template["tool_use"]
        if "default" in template:
            return template["default"]
        raise InvalidRequestError(
            f"this model has named chat templates ({', '.join(sorted(template))}) but no 'default' one"
        )


class IncrementalDetokenizer:
    """Turns generated ids, fed one at a time, into text deltas, with ``tokenizers``'
    ``DecodeStream``.

    Decoding one token alone is wrong in two ways: a byte-level BPE token may hold only part
    of a multi-byte UTF-8 character, and some decoders change a token's text depending on its
    neighbours (SentencePiece's leading space). ``DecodeStream`` keeps the window of ids it
    needs and returns None until a token completes a character; the last few prompt ids seed
    it, so that the first generated token decodes as it would in the middle of the text.

    Invariant: the concatenation of every ``step`` result and ``flush`` equals
    ``tokenizer.decode(generated_ids, skip_special_tokens)`` for well-formed output, and no
    step returns a partial character.
    """

    # Prompt tokens kept as left context so the first generated token decodes as it would
    # in the middle of the text.
    PROMPT_CONTEXT_TOKENS = 6

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = [int(i) for i in prompt_ids[-self.PROMPT_CONTEXT_TOKENS :]] if prompt_ids else []
        if context and tokenizer.decode(context, skip_special_tokens).endswith("\ufffd"):
            # A prompt ending mid-character: DecodeStream would emit the prompt's bytes with the
            # first generated token. Such a prompt gets no context.
            context = []
        self._stream = DecodeStream(ids=context or None, skip_special_tokens=skip_special_tokens)
        self._held: list[int] = []  # ids fed since the last text, an incomplete character

    def step(self, token_id: int) -> str:
        """Add one generated id; return the text it completes (possibly "")."""
        chunk = self._stream.step(self._tokenizer.backend, int(token_id))
        if chunk is None:
            self._held.append(int(token_id))
            return ""
        self._held.clear()
        return str(chunk)

    def flush(self) -> str:
        """Return whatever is still held back (an incomplete character at the end)."""
        held, self._held = self._held, []
        return self._tokenizer.decode(held, self._skip_special_tokens) if held else ""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes a special token as a string or as an AddedToken dict.
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value if isinstance(v, int)]
    return []


def _chat_template_from(tokenizer_config: Mapping[str, Any], root: Path) -> str | dict[str, str] | None:
    raw = tokenizer_config.get("chat_template")
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        return {str(item["name"]): str(item["template"]) for item in raw if isinstance(item, Mapping)}
    # Newer transformers save the template in its own file instead.
    jinja_path = root / "chat_template.jinja"
    if jinja_path.is_file():
        return jinja_path.read_text(encoding="utf-8")
    return None


def _normalizer_shrink(normalizer: Mapping[str, Any] | None) -> int | None:
    """How many times ``normalizer`` can shrink a text's UTF-8 size; None when unbounded."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        total = 1
        for step in normalizer.get("normalizers") or ():
            factor = _normalizer_shrink(step)
            if factor is None:
                return None
            total *= factor
        return total
    if kind == "Replace":
        pattern, content = normalizer.get("pattern") or {}, normalizer.get("content")
        literal = pattern.get("String")
        if isinstance(literal, str) and literal and isinstance(content, str):
            return 1 if len(content.encode()) >= len(literal.encode()) else None
        return None
    return _NORMALIZER_SHRINK.get(str(kind))


def _pre_tokenizer_types(pre_tokenizer: Mapping[str, Any] | None) -> set[str] | None:
    """The pre-tokenizer types in use, or None when one of them can drop text."""
    if pre_tokenizer is None:
        return set()
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        types: set[str] = set()
        for step in pre_tokenizer.get("pretokenizers") or ():
            inner = _pre_tokenizer_types(step)
            if inner is None:
                return None
            types |= inner
        return types
    if kind not in _KEEPING_PRE_TOKENIZERS or (kind == "Split" and pre_tokenizer.get("behavior") == "Removed"):
        return None
    return {str(kind)}


# apply_chat_template's own arguments: extra template variables may not be named so.
_RENDER_ARGUMENTS = frozenset({"self", "messages", "tools", "add_generation_prompt", "continue_final_message"})


def check_template_variables(variables: Mapping[str, Any]) -> None:
    """InvalidRequestError when an extra chat template variable would take the place of one of
    ``Tokenizer.apply_chat_template``'s arguments."""
    reserved = sorted(set(variables) & _RENDER_ARGUMENTS)
    if reserved:
        raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(reserved)}: "
                                  "the request's own fields set them")


def _cut_at_mark(rendered: str, mark: str) -> str:
    """``rendered`` up to ``mark``, which followed the final message's text: what the template
    wrote after that text (its end-of-turn) goes. A mark is used rather than a search for the text
    itself, which could also match inside the template's own tokens ("d" in "<|im_end|>")."""
    end = rendered.rfind(mark)
    if end < 0:
        raise InvalidRequestError("continue_final_message: the chat template does not write the last message's text, "
                                  "so it cannot be continued")
    return rendered[:end]


def _validate_messages(messages: Any) -> None:
    if not isinstance(messages, (list, tuple)):
        raise InvalidRequestError(f"messages must be a list of message objects, got {type(messages).__name__}")
    if not messages:
        raise InvalidRequestError("messages must not be empty")
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, Mapping):
            raise InvalidRequestError(
                f"{where} must be an object with 'role' and 'content', got {type(message).__name__}"
            )
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"{where}.role must be a non-empty string")
        content = message.get("content")
        # An assistant turn that only calls tools has no text.
        if content is None and message.get("tool_calls"):
            continue
        if not isinstance(content, str):
            got = "missing" if "content" not in message else type(content).__name__
            raise InvalidRequestError(f"{where}.content must be a string, got {got}")


def _with_reasoning_aliases(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers uses it to mark assistant
    tokens for training masks; for serving it only renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore attributes, so templates cannot reach internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - same trick as jinja2's Namespace
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attribute {name!r}")


class _TemplateDict:
    """``dict()`` for templates without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, keys: Iterable[Any], value: Any = None) -> dict[Any, Any]:
        return dict.fromkeys(keys, value)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson HTML-escapes <, >, & and ' and cannot indent; templates expect neither.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _environment() -> ImmutableSandboxedEnvironment:
    # Chat templates come with downloaded models: untrusted code, hence the immutable sandbox.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    """The template compiled once per source (a compiled template renders concurrently)."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidRequestError(f"the model's chat template does not compile: {exc}") from None


@lru_cache(maxsize=16)
def _template_reads(source: str) -> frozenset[str]:
    """The variables a template reads that it does not set itself (jinja2's own analysis)."""
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(source)))
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidRequestError(f"the model's chat template does not compile: {exc}") from None


@lru_cache(maxsize=1)
def _byte_level_symbols() -> dict[int, str]:
    """Byte value -> its ByteLevel symbol, for every byte that UTF-8 text can contain, read from
    the ByteLevel pre-tokenizer itself: characters of every UTF-8 length, byte by byte."""
    pre = ByteLevel(add_prefix_space=False, use_regex=False)
    chars = [chr(c) for c in range(0x80)] + [chr(c) for c in range(0x80, 0x800)]
    chars += [chr(0x1000 * lead + 0x800 if lead == 0 else 0x1000 * lead) for lead in range(16)
              if not 0xD800 <= 0x1000 * lead < 0xE000] + ["\ud7ff", "\U00010000", "\U00040000", "\U00080000", "\U000c0000", "\U00100000"]
    symbols: dict[int, str] = {}
    for ch in chars:
        pieces = pre.pre_tokenize_str(ch)
        if pieces:
            symbols.update(zip(ch.encode("utf-8"), pieces[0][0], strict=True))
    return symbols
