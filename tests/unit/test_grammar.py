"""Structured output (``tandem.engine.grammar``): llguidance's masks over the default model's real
tokenizer, through the batched Sampler. Random logits stand in for a model: whatever a model
prefers, what comes out must keep to the grammar and end where it is complete."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.engine.errors import InvalidRequestError
from tandem.engine.grammar import MATCHER_KEEP_STEPS, MAX_JSON_WHITESPACE, Grammars, grammar_for
from tandem.engine.sampling import Sampler, SamplingBatch, SamplingParams, make_generator
from tandem.engine.tokenizer import Tokenizer
from tandem.protocol import MAX_GRAMMAR_CHARS

MAX_STEPS = 1500


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


@pytest.fixture(scope="module")
def grammars(smollm2_dir: Path, tokenizer: Tokenizer) -> Grammars:
    return Grammars.for_model_dir(smollm2_dir, tokenizer.vocab_size, tokenizer.eos_token_ids)


# Bounded schemas: every value has a most length, so a walk that keeps to the grammar ends.
_names = st.text(alphabet="abcxyz_é", min_size=1, max_size=6)
_leaf = st.one_of(
    st.tuples(st.integers(-50, 50), st.integers(0, 200)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.text(alphabet="ab é\"\\", min_size=1, max_size=5), min_size=1, max_size=3, unique=True).map(
        lambda v: {"enum": v}),
    st.integers(0, 8).map(lambda n: {"type": "string", "maxLength": n}),
)
_value = st.one_of(_leaf, _leaf.map(lambda item: {"type": "array", "items": item, "maxItems": 3}))


def _object(values: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(_names, values, min_size=1, max_size=4).flatmap(lambda props: st.lists(
        st.sampled_from(sorted(props)), unique=True).map(lambda required: {
            "type": "object", "properties": props, "required": required, "additionalProperties": False}))


_schemas = _object(st.one_of(_value, _object(_leaf)))


def _walk(grammars: Grammars, params: list[SamplingParams], eos: tuple[int, ...], seed: int,
          stop_at_eos: bool = True, steps: int = MAX_STEPS) -> list[list[int]]:
    """Sample every row of a batch to its end (EOS, or ``steps``) from random logits, through the
    Sampler with ``grammars``: the outputs."""
    vocab = grammars.vocab_size
    sampler = Sampler(grammars)
    logits_gen = torch.Generator().manual_seed(seed)
    generators = [make_generator(p.seed) for p in params]
    outputs: list[list[int]] = [[] for _ in params]
    live = list(range(len(params)))
    for _ in range(steps):
        if not live:
            break
        batch = SamplingBatch.build([params[i] for i in live], [[1, 2, 3]] * len(live), [outputs[i] for i in live],
                                    [generators[i] for i in live], eos, vocab)
        logits = torch.randn(len(live), vocab, generator=logits_gen) * 4
        tokens = sampler.sample(logits, batch).token_ids
        for i, token in zip(live, tokens, strict=True):
            outputs[i].append(token)
        if stop_at_eos:
            live = [i for i in live if outputs[i][-1] not in eos]
    return outputs


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schemas=st.lists(_schemas, min_size=1, max_size=3), greedy=st.lists(st.booleans(), min_size=3, max_size=3),
       seed=st.integers(0, 2**31 - 1))
def test_a_batch_of_json_schemas_walked_by_random_logits_ends_in_valid_json(
        grammars: Grammars, tokenizer: Tokenizer, schemas: list[dict[str, Any]], greedy: list[bool],
        seed: int) -> None:
    eos = tokenizer.eos_token_ids
    params = [SamplingParams(temperature=0.0 if g else 1.0, seed=seed + i, max_tokens=MAX_STEPS,
                             grammar=grammar_for("json", schema)) for i, (schema, g) in enumerate(zip(schemas, greedy))]
    for schema, output in zip(schemas, _walk(grammars, params, eos, seed), strict=True):
        assert output[-1] in eos, (schema, tokenizer.decode(output))
        text = tokenizer.decode(output[:-1])
        jsonschema.validate(json.loads(text), schema)
        gaps = re.findall(r"[ \t\r\n]+", re.sub(r'"(\\.|[^"\\])*"', '""', text))
        assert all(len(gap) <= MAX_JSON_WHITESPACE for gap in gaps), text


@pytest.mark.parametrize(("kind", "spec", "check"), [
    ("regex", r"[a-c]{1,4}-[0-9]{2}", lambda text: re.fullmatch(r"[a-c]{1,4}-[0-9]{2}", text)),
    ("regex", r"(yes|no|maybe), [A-Z][a-z]{0,5}\.", lambda text: re.fullmatch(r"(yes|no|maybe), [A-Z][a-z]{0,5}\.", text)),
    ("choice", ["Paris", "London", "Rome", "a b c"], lambda text: text in ("Paris", "London", "Rome", "a b c")),
    ("grammar", 'start: "(" num ("," num)? ")"\nnum: /[0-9]{1,3}/', lambda text: re.fullmatch(r"\(\d{1,3}(,\d{1,3})?\)", text)),
    ("grammar", 'root ::= "[" item ("," item)? "]"\nitem ::= [a-z]', lambda text: re.fullmatch(r"\[[a-z](,[a-z])?\]", text)),
])
def test_regexes_choices_grammars_and_any_object_keep_their_shape(
        grammars: Grammars, tokenizer: Tokenizer, kind: str, spec: Any, check: Any) -> None:
    eos = tokenizer.eos_token_ids
    grammar = grammar_for(kind, spec)
    rng = random.Random(kind)
    for round_ in range(4):
        params = [SamplingParams(temperature=rng.choice([0.0, 1.0]), seed=rng.randrange(1000), grammar=grammar)]
        [output] = _walk(grammars, params, eos, seed=round_)
        assert output[-1] in eos
        text = tokenizer.decode(output[:-1])
        assert check(text), (kind, spec, text)


@pytest.mark.parametrize(("text", "fits"), [
    ('{"a": [1, {"b": null}], "c": "x\\u00e9"}', True),
    ('{}', True),
    ('{"k":true,"n":-1.5e3}', True),
    ('[1, 2]', False),
    ('"just a string"', False),
    ('{"a": 1,}', False),
])
def test_json_object_allows_exactly_the_objects(grammars: Grammars, tokenizer: Tokenizer, text: str, fits: bool) -> None:
    """Any JSON object (OpenAI's json_object): a text's tokens walk through the masks one by one,
    and EOS is allowed at the end, exactly when the text is an object."""
    assert isinstance(json.loads(text), dict) if fits else True
    grammar = grammar_for("json_object", None)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    rows = [(grammar, tokens[:i]) for i in range(len(tokens) + 1)]
    mask = grammars.allowed(rows)
    walked = all(bool(mask[i, t]) for i, t in enumerate(tokens))
    ends = walked and any(bool(mask[-1, e]) for e in tokenizer.eos_token_ids)
    assert ends == fits, text


def test_the_cached_matchers_give_the_masks_of_matchers_built_afresh(grammars: Grammars, tokenizer: Tokenizer) -> None:
    """Rows that share a grammar and a prefix, diverge, repeat a step and come back out of order:
    each mask equals the one a fresh Grammars builds from the whole output."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 12}, "b": {"type": "integer"}},
              "required": ["a", "b"]}
    grammar = grammar_for("json", schema)
    rng = random.Random(7)
    outputs: list[list[int]] = [[], [], []]
    fresh = Grammars(grammars._tokenizer_json, grammars.vocab_size, grammars.eos_token_ids, cache_size=0)
    built = grammars.num_built
    for step in range(40):
        rows = [(grammar, out) for out in outputs] + [("", [])]
        if step % 7 == 3:
            rows.append((grammar, list(outputs[0])))  # the same output twice in one batch
        mask = grammars.allowed(rows)
        assert torch.equal(mask, fresh.allowed(rows)), step
        assert bool(mask[len(outputs)].all())  # the row without a grammar
        for i, out in enumerate(outputs):
            allowed = mask[i].nonzero().flatten().tolist()
            if step < 3 and i > 0:
                out[:] = list(outputs[0])  # the same prefix as row 0 so far
            if out and out[-1] in tokenizer.eos_token_ids:
                continue
            out.append(rng.choice(allowed))
    assert grammars.num_built - built < fresh.num_built / 4  # the cache found most matchers


def test_a_completed_grammar_allows_eos_alone_even_past_min_tokens_and_with_ignore_eos(
        grammars: Grammars, tokenizer: Tokenizer) -> None:
    eos = tokenizer.eos_token_ids
    grammar = grammar_for("choice", ["done"])
    params = [SamplingParams(temperature=1.0, seed=3, grammar=grammar, min_tokens=6, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.0, grammar=grammar, min_tokens=4, max_tokens=10)]
    outputs = _walk(grammars, params, eos, seed=1, stop_at_eos=False, steps=10)
    for output in outputs:
        text_tokens = [t for t in output if t not in eos]
        assert tokenizer.decode(text_tokens) == "done"
        assert all(t in eos for t in output[len(text_tokens):]) and len(output) == 10


def test_matchers_of_requests_that_ended_do_not_linger(grammars: Grammars, tokenizer: Tokenizer) -> None:
    """A finished request's matcher (about 200 kB) goes within MATCHER_KEEP_STEPS steps, with or
    without grammars in them; a running request's stays and is never built again."""
    eos = tokenizer.eos_token_ids
    local = Grammars(grammars._tokenizer_json, grammars.vocab_size, eos, cache_size=8)
    grammar = grammar_for("regex", r"[a-z ]{0,400}")
    rng = random.Random(11)
    allowed = local.allowed([(grammar, [])])[0].nonzero().flatten().tolist()
    ended = [[rng.choice(allowed)] for _ in range(20)]
    local.allowed([(grammar, out) for out in ended])
    assert local.num_cached == 8  # the cap
    running: list[int] = []
    for step in range(MATCHER_KEEP_STEPS + 2):
        rows = [(grammar, running)] if step % 2 else [("", [])]  # steps without grammars count too
        if rows[0][0]:
            mask = local.allowed(rows)
            running.append(rng.choice(mask[0].nonzero().flatten().tolist()))
        else:
            local.tick()
    assert local.num_cached == 1  # the running request's alone
    built = local.num_built
    local.allowed([(grammar, running)])
    assert local.num_built == built
    Sampler(local).sample(torch.zeros(1, local.vocab_size), SamplingBatch.build(
        [SamplingParams()], [[1]], [[]], [None], eos, local.vocab_size))  # a step with no grammar ticks
    never = Grammars(grammars._tokenizer_json, grammars.vocab_size, eos, cache_size=0)
    never.allowed([(grammar, out) for out in ended[:3]])
    assert never.num_cached == 0


@pytest.mark.parametrize(("kind", "spec", "words"), [
    ("json", {"type": "nonsense"}, "nonsense"),
    ("json", "{not json", "not JSON"),
    ("json", [1, 2], "must be an object"),
    ("json", {"type": "string", "pattern": "(unclosed"}, "invalid"),
    ("regex", "", "non-empty"),
    ("regex", "(ab", "unclosed"),
    ("choice", [], "non-empty list"),
    ("choice", ["a", 3], "non-empty list"),
    ("grammar", "start: foo\nfoo: \"a\" bar", "bar"),
    ("xml", "<a/>", "unknown structured output kind"),
])
def test_bad_specs_are_refused_naming_what_is_wrong(kind: str, spec: Any, words: str) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(words)):
        grammar_for(kind, spec)


def test_a_grammar_past_the_limit_is_refused_wherever_it_comes_from() -> None:
    big = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(6000)}}
    with pytest.raises(InvalidRequestError, match="at most"):
        grammar_for("json", big)
    with pytest.raises(InvalidRequestError, match="at most"):
        SamplingParams(grammar="x" * (MAX_GRAMMAR_CHARS + 1))  # as the gRPC API may send it


def test_a_grammar_reaching_a_sampler_without_grammars_is_a_clear_error(tokenizer: Tokenizer) -> None:
    params = [SamplingParams(grammar=grammar_for("choice", ["x"]))]
    batch = SamplingBatch.build(params, [[1]], [[]], [None], tokenizer.eos_token_ids, tokenizer.vocab_size)
    with pytest.raises(InvalidRequestError, match="structured output"):
        Sampler().sample(torch.zeros(1, tokenizer.vocab_size), batch)
