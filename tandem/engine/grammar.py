"""Structured output: the tokens a request's grammar allows next, from llguidance.

A request asks for a shape (OpenAI's ``response_format``: any JSON object or a JSON schema; vLLM's
``structured_outputs`` / ``guided_*``: a regex, a choice of strings, a Lark or GBNF grammar). The
router turns it into one llguidance grammar string (``grammar_for``), checks it against the
model's tokenizer (``Grammars.check``: a bad schema is a 400 there, never a failed step), and sends
it in ``SamplingParams.grammar``. Whoever samples (prefill_svc for the first token, decode_svc for
the rest, the in-process engine) masks every token the grammar does not allow next
(``Grammars.allowed``). Once the grammar is complete only EOS is allowed, so a request ends where
its JSON (or match) ends; with ``ignore_eos`` it goes on emitting EOS, which the text leaves out.

The matcher of a request is state (what it has consumed), but no caller has to keep it: the
cache is keyed by the grammar and the tokens output so far, so a step finds the matcher of the
step before by the output less its last token and feeds it that token. A process that never saw
the request (decode after prefill's first token, a restarted decode resuming it, a readmission)
builds the matcher again from the output: the same state, a few microseconds a token. Two
requests with the same grammar and the same output share nothing: the first takes the matcher,
the second builds its own.

JSON whitespace is bounded (at most ``MAX_JSON_WHITESPACE`` characters between two elements, as
llama.cpp's JSON grammar bounds it) so that a model cannot spend its whole budget on blanks.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from tandem.engine.errors import InvalidRequestError
from tandem.protocol import MAX_GRAMMAR_CHARS

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MAX_JSON_WHITESPACE = 16
# Matchers kept between steps (one per request decoding with a grammar), at most this many and
# only those used in the last MATCHER_KEEP_STEPS masks; an evicted one is built again from the
# request's output. A matcher holds about 200 kB, so a finished request's must not linger.
MATCHER_CACHE_SIZE = 512
MATCHER_KEEP_STEPS = 32
# Any valid JSON within the schema (\u escapes of any character included), whitespace bounded.
_JSON_OPTIONS = {"whitespace_flexible": False, "whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{MAX_JSON_WHITESPACE}}}",
                 "json_allow_general_unicode_escapes": True}
# The kinds of structured output a request may ask for, by the name vLLM's ``structured_outputs``
# gives each: a JSON schema, any JSON object, a regular expression, one of a list of strings,
# a Lark (or GBNF) grammar.
KINDS = ("json", "json_object", "regex", "choice", "grammar")


_WHAT = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def _llguidance() -> Any:
    import llguidance

    return llguidance


def structured_output_of(outputs: Any) -> tuple[str, Any]:
    """The (kind, spec) that vLLM's ``structured_outputs`` object asks for: exactly one of ``KINDS``
    set to something other than None or False (other keys, such as vLLM's whitespace options, are
    left out). InvalidRequestError otherwise."""
    named = ({k: v for k, v in outputs.items() if k in KINDS and v not in (None, False)}
             if isinstance(outputs, Mapping) else {})
    if len(named) != 1:
        raise InvalidRequestError(f"structured_outputs must name exactly one of {', '.join(KINDS)}, "
                                  f"got {str(outputs)[:200]}")
    [(kind, spec)] = named.items()
    return kind, spec


def grammar_for(kind: str, spec: Any) -> str:
    """The llguidance grammar of a request's structured output ``kind`` (one of ``KINDS``) with
    ``spec`` (the schema as a dict or its JSON text, the regex, the list of choices, the grammar's
    text; ignored for ``json_object``). Raises InvalidRequestError naming what is wrong."""
    llg = _llguidance()
    if kind == "json_object":
        kind, spec = "json", {"type": "object"}
    if kind == "json":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"the JSON schema is not JSON: {exc}") from None
        if isinstance(spec, bool):
            spec = {} if spec else {"not": {}}
        if not isinstance(spec, dict):
            raise InvalidRequestError(f"a JSON schema must be an object, got {type(spec).__name__}")
        try:
            grammar: str = llg.LLMatcher.grammar_from_json_schema(spec, defaults=_JSON_OPTIONS)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"the JSON schema is invalid: {exc}") from None
    elif kind == "regex":
        if not isinstance(spec, str) or not spec:
            raise InvalidRequestError("a regex must be a non-empty string")
        grammar = llg.LLMatcher.grammar_from_regex(spec)
    elif kind == "choice":
        if (not isinstance(spec, list) or not spec
                or not all(isinstance(c, str) and c for c in spec)):
            raise InvalidRequestError("choice must be a non-empty list of non-empty strings")
        grammar = llg.grammar_from("choice", json.dumps(spec))
    elif kind == "grammar":
        if not isinstance(spec, str) or not spec.strip():
            raise InvalidRequestError("a grammar must be a non-empty string (Lark or GBNF)")
        try:
            grammar = llg.grammar_from("grammar", spec)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
    else:
        raise InvalidRequestError(f"unknown structured output kind {kind!r}; one of {', '.join(KINDS)}")
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise InvalidRequestError(f"the grammar is {len(grammar)} characters; at most {MAX_GRAMMAR_CHARS}")
    error = llg.LLMatcher.validate_grammar(grammar, None)  # what needs no tokenizer (Grammars.check does the rest)
    if error:
        raise InvalidRequestError(f"the {_WHAT[kind]} is invalid: {error.strip()}")
    return grammar


class Grammars:
    """One model's grammar masks: its tokenizer as llguidance reads it (built on first use, about
    0.2 s for a 49k vocabulary) and the matchers of the requests decoding with a grammar.

    ``tokenizer_json`` returns the model's ``tokenizer.json`` text; ``vocab_size`` is the logits'
    width (tokens past the tokenizer's are never allowed); ``eos_token_ids`` end a completed grammar;
    ``cache_size`` matchers are kept between steps (0: every mask from a matcher built afresh).
    Thread-safe: a service's loop checks grammars while its torch thread samples.
    """

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = MATCHER_CACHE_SIZE) -> None:
        self._tokenizer_json = tokenizer_json
        self.cache_size = cache_size
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        # (grammar, output) -> (matcher, the step it was last used in), least recently used first
        self._matchers: OrderedDict[tuple[str, tuple[int, ...]], tuple[Any, int]] = OrderedDict()
        self._step = 0  # masks computed (``allowed`` calls) and steps without any (``tick``)
        self.num_built = 0  # matchers built from a whole output (not found by the step before's)

    @classmethod
    def for_model_dir(cls, model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int],
                      cache_size: int = MATCHER_CACHE_SIZE) -> Self:
        from tandem.engine.tokenizer import Tokenizer

        return cls(lambda: Tokenizer.from_dir(model_dir).backend.to_str(), vocab_size, eos_token_ids, cache_size)

    def _llg_tokenizer(self) -> Any:
        if self._tokenizer is None:
            eos = list(self.eos_token_ids) or None
            self._tokenizer = _llguidance().LLTokenizer(self._tokenizer_json(), n_vocab=self.vocab_size,
                                                        eos_token=eos)
        return self._tokenizer

    def check(self, grammar: str) -> None:
        """Raise InvalidRequestError with llguidance's message when ``grammar`` does not compile
        for this tokenizer."""
        with self._lock:
            tokenizer = self._llg_tokenizer()
        error = _llguidance().LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise InvalidRequestError(f"the structured output's grammar is invalid: {error}")

    def _matcher(self, grammar: str, output: tuple[int, ...]) -> Any:
        """A matcher that has consumed ``output`` (from the cache when it holds the one for
        ``output`` less its last token, or ``output`` itself)."""
        llg = _llguidance()
        before = self._matchers.pop((grammar, output[:-1]), None) if output else None
        if before is not None:
            before[0].consume_token(output[-1])
            return before[0]
        same = self._matchers.pop((grammar, output), None)
        if same is not None:
            return same[0]
        self.num_built += 1
        matcher = llg.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if output:
            matcher.consume_tokens(list(output))
        return matcher

    def allowed(self, rows: Sequence[tuple[str, Sequence[int]]]) -> torch.Tensor:
        """[len(rows), vocab_size] bool: the tokens each row's grammar allows after its output
        (a row of ``(grammar, output token ids)``; an empty grammar allows every token). A matcher
        in error (a token it did not allow reached it: never through this mask) or completed
        allows the EOS tokens only, so the request ends."""
        import torch  # here: the client SDK imports this module for grammar_for, without torch

        mask = torch.ones(len(rows), self.vocab_size, dtype=torch.bool)
        shifts = torch.arange(8, dtype=torch.uint8)
        with self._lock:
            for i, (grammar, output) in enumerate(rows):
                if not grammar:
                    continue
                key = (grammar, tuple(output))
                matcher = self._matcher(grammar, key[1])
                if matcher.is_error():
                    log.warning("a grammar's matcher failed (%s): the request may only end now",
                                matcher.get_error()[:200])
                    mask[i] = False
                    mask[i, [t for t in self.eos_token_ids if 0 <= t < self.vocab_size]] = True
                else:
                    bits = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.uint8)
                    row = ((bits.unsqueeze(1) >> shifts) & 1).flatten()[: self.vocab_size].bool()
                    mask[i, : row.numel()] = row
                    mask[i, row.numel():] = False
                self._matchers[key] = (matcher, self._step)
            self._expire()
        return mask

    @property
    def num_cached(self) -> int:
        return len(self._matchers)

    def tick(self) -> None:
        """A step without any grammar: matchers unused for MATCHER_KEEP_STEPS steps go."""
        if self._matchers:
            with self._lock:
                self._expire()

    def _expire(self) -> None:
        self._step += 1
        oldest = self._step - MATCHER_KEEP_STEPS
        while self._matchers and (len(self._matchers) > self.cache_size
                                  or next(iter(self._matchers.values()))[1] < oldest):
            self._matchers.popitem(last=False)
