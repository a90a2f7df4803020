"""Bad input, checked without a server: the prompt-size bound of the tokenizer, the naming of
undecodable gRPC requests, and the HTTP request parser under random bodies (issue 11, items 7
and 8). The live side is tests/integration/test_bad_input.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, normalizers, pre_tokenizers

from router.core import brief
from router.http import HTTPError, parse_request
from router.wire_errors import Undecodable, _tolerant, invalid_utf8_field
from tandem.engine.tokenizer import Tokenizer
from tandem.protocol import RequestError, Status
from tandem.rpc.v1 import common_pb2, router_pb2

CONTEXT = 2048
PARAMS = ["model", "messages", "prompt", "n", "temperature", "top_p", "top_k", "min_p", "stop", "seed", "stream",
          "stream_options", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "ignore_eos", "user", "min_tokens", "max_tokens", "max_completion_tokens"]
FUZZ = settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


# --- the prompt-size bound ----------------------------------------------------------------------

def test_smollm2_bound_is_its_longest_token_plus_one(smollm2: Tokenizer) -> None:
    # Its longest token is a newline and 80 spaces (81 bytes).
    assert smollm2.max_bytes_per_token == 82
    assert smollm2.max_text_bytes(8191) == 8191 * 82


def test_bytes_whose_symbol_the_vocabulary_lacks_are_dropped_and_not_counted(smollm2: Tokenizer) -> None:
    assert smollm2.encode("\x16" * 1000) == [] and smollm2.kept_bytes("\x16" * 1000) == 0
    assert smollm2.kept_bytes("a\x16b\x04") == 2 and smollm2.kept_bytes("é") == 2
    dropped = [chr(b) for b in range(128) if smollm2.encode(chr(b)) == []]
    assert dropped and all(smollm2.kept_bytes(c) == 0 for c in dropped)
    assert all(smollm2.kept_bytes(chr(b)) == 1 for b in range(128) if chr(b) not in dropped)


@settings(max_examples=200, deadline=None, database=None)
@given(text=st.text(max_size=400) | st.lists(st.sampled_from([" ", "\n", "\t", "a", "é", "😀", "\u0301", "-", "0",
                                                              "\x16", "\x04", "\U00040000"]),
                                             max_size=600).map("".join))
def test_no_text_packs_more_bytes_per_token_than_the_bound(smollm2: Tokenizer, text: str) -> None:
    ids = smollm2.encode(text)
    assert smollm2.kept_bytes(text) <= len(ids) * (smollm2.max_bytes_per_token or 0)


def test_bound_follows_the_normalizer_and_refuses_lossy_tokenizers() -> None:
    vocab = {chr(c): i for i, c in enumerate(range(ord("a"), ord("z") + 1))}
    vocab["ab"] = len(vocab)
    vocab["abc"] = len(vocab)

    def bpe(normalizer: Any = None, pre: Any = None, **model_args: Any) -> Tokenizer:
        backend = BackendTokenizer(models.BPE(vocab=dict(vocab), merges=[("a", "b"), ("ab", "c")], **model_args))
        if normalizer is not None:
            backend.normalizer = normalizer
        if pre is not None:
            backend.pre_tokenizer = pre
        return Tokenizer(backend)

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert bpe(pre=byte_level).max_bytes_per_token == 4  # "abc" and one for a dropped leading space
    assert bpe(normalizers.NFKC(), byte_level).max_bytes_per_token == 16  # NFKC may shrink text 4x
    assert bpe(normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]),
               byte_fallback=True).max_bytes_per_token == 4
    # No bound: unknown characters without byte fallback, stripping, dropped whitespace, WordPiece.
    assert bpe(unk_token="a").max_bytes_per_token is None
    assert bpe(normalizers.Strip(), byte_level).max_bytes_per_token is None
    assert bpe(pre=pre_tokenizers.Whitespace(), byte_fallback=True).max_bytes_per_token is None
    wordpiece = BackendTokenizer(models.WordPiece(vocab={"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    assert Tokenizer(wordpiece).max_text_bytes(10) is None


def test_releasing_encode_equals_encode(smollm2: Tokenizer) -> None:
    text = "Hello, world! 1234 ünïcödé 😀\n\n    indented"
    assert smollm2.encode_releasing_gil(text) == smollm2.encode(text)
    assert smollm2.encode_releasing_gil(text, add_special_tokens=False) == smollm2.encode(text, add_special_tokens=False)


# --- undecodable gRPC requests ----------------------------------------------------------------

def _request_bytes() -> bytes:
    return router_pb2.GenerateRequest(
        model="m", request_id="rid", stop=["s0", "s1"],
        messages=router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user", content="c0"),
                                                   router_pb2.ChatMessage(role="user", content="c1")]),
    ).SerializeToString()


@pytest.mark.parametrize(("value", "field"), [
    (b"m", "model"), (b"rid", "request_id"), (b"s1", "stop[1]"),
    (b"c1", "messages.messages[1].content"), (b"user", "messages.messages[0].role"),
])
def test_invalid_utf8_is_named_by_field(value: bytes, field: str) -> None:
    data = _request_bytes().replace(value, b"\xff" * len(value), 1)
    got = _tolerant(router_pb2.GenerateRequest.FromString)(data)
    assert isinstance(got, Undecodable)
    assert got.message == (f"the request is not a valid tandem.v1.GenerateRequest: field {field} is not valid "
                           "UTF-8 (protobuf strings must be UTF-8 text)")


@FUZZ
@given(data=st.binary(max_size=64), cut=st.integers(0, 200))
def test_any_bytes_deserialize_or_explain(data: bytes, cut: int) -> None:
    deserialize = _tolerant(router_pb2.GenerateRequest.FromString)
    for frame in (data, _request_bytes()[:cut] + data):
        got = deserialize(frame)
        if isinstance(got, Undecodable):
            assert got.message.startswith("the request is not a valid tandem.v1.GenerateRequest: ")
            assert invalid_utf8_field(router_pb2.GenerateRequest.DESCRIPTOR, frame) is None or "field" in got.message
        else:
            assert isinstance(got, router_pb2.GenerateRequest)


# --- HTTP parsing ------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=16,
)


@FUZZ
@given(kind=st.sampled_from(["chat", "completion"]),
       body=st.dictionaries(st.sampled_from(PARAMS), json_values, max_size=8) | json_values)
def test_parse_request_accepts_or_says_400(kind: Any, body: Any) -> None:
    try:
        parsed = parse_request(kind, body, CONTEXT, "req")
    except HTTPError as exc:
        assert exc.status == 400
        assert len(exc.message) < 400  # what the client sent is quoted short, never whole
        if isinstance(body, dict):
            assert exc.param is None or exc.param in PARAMS
        return
    assert 1 <= len(parsed.requests) <= 16
    for request in parsed.requests:
        assert len(request.stop) <= 16 and len(request.messages.messages) <= 1024


def test_errors_quote_what_was_sent_briefly() -> None:
    huge = list(range(100_000))
    for name in ("temperature", "n", "max_tokens"):
        with pytest.raises(HTTPError) as info:
            parse_request("chat", {"messages": [{"role": "user", "content": "x"}], name: huge}, CONTEXT, "r")
        assert info.value.param == name and len(info.value.message) < 200
    assert len(brief("x" * 10**6)) < 100


def test_rejections_name_the_openai_parameter() -> None:
    cases = [("text", "prompt"), ("token_ids", "prompt"), ("messages", "messages"), ("stop", "stop"),
             ("sampling", None), ("request_id", None)]
    for field, param in cases:
        error = HTTPError.from_error(RequestError(Status.INVALID_ARGUMENT, "bad", field=field))
        assert (error.status, error.param) == (400, param)
    in_flight = HTTPError.from_error(RequestError(Status.ALREADY_EXISTS, "busy", field="request_id"))
    assert in_flight.status == 409


def test_sampling_proto_round_trip_keeps_limits() -> None:
    # A hostile gRPC client can send any sampling values; the router's own converter refuses them.
    from router.core import sampling_from_request
    from tandem.engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        sampling_from_request(common_pb2.SamplingParams(stop_token_ids=list(range(100_000))))

