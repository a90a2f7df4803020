"""The torch-free protocol module: one set of sampling limits, read alike by the engine's
validator, the OpenAI parser and the OpenAPI schema; the router process imports no torch."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.http import HTTPError, openapi_schema, parse_request
from tandem.engine.errors import InvalidRequestError
from tandem.protocol import SAMPLING_LIMITS, FinishReason, LoadReport, RequestError, SamplingParams, Status
from tandem.rpc.convert import finish_from_proto, finish_to_proto, retry_after_from, retry_after_metadata

CONTEXT = 64
MESSAGES = [{"role": "user", "content": "hi"}]


def test_the_router_package_imports_no_torch() -> None:
    # A fresh interpreter: this test process may have torch from other tests.
    code = ("import sys, router.__main__, router.server, router.http, router.admission, router.metrics\n"
            "from tandem.perf.predictor import cpu_predictor\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def _schema_properties(kind: str) -> dict[str, Any]:
    """The request body's properties, each the schema of its non-null value."""
    schema = openapi_schema(CONTEXT)
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    body = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
    out: dict[str, Any] = {}
    for name, prop in body["properties"].items():
        branches = [b for b in prop.get("anyOf", [prop]) if b.get("type") != "null"]
        out[name] = branches[0]
    return out


def _edges(name: str) -> tuple[list[float], list[float]]:
    """Values the schema admits and values it refuses, at the edges of its range for ``name``."""
    prop = _schema_properties("chat")[name]
    lo = prop.get("minimum", prop.get("exclusiveMinimum"))
    hi = prop.get("maximum")
    inside = [lo + 1e-3, (lo + hi) / 2 if hi is not None else lo + 1]
    outside = [lo - 1e-3]
    if hi is not None:
        inside.append(hi)
        outside.append(hi + 1e-3)
    if "exclusiveMinimum" in prop:
        outside.append(lo)
    else:
        inside.append(lo)
    return inside, outside


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                  "repetition_penalty"])
def test_schema_parser_and_validator_agree_on_every_sampling_limit(name: str) -> None:
    inside, outside = _edges(name)
    for value in inside:
        parse_request("chat", {"messages": MESSAGES, name: value}, CONTEXT, "r")
        SamplingParams(**{name: value})
    for value in outside:
        with pytest.raises(HTTPError) as info:
            parse_request("chat", {"messages": MESSAGES, name: value}, CONTEXT, "r")
        assert info.value.param == name
        with pytest.raises(InvalidRequestError, match=name):
            SamplingParams(**{name: value})


def test_every_limit_is_in_the_schema() -> None:
    chat, completion = _schema_properties("chat"), _schema_properties("completion")
    for name, limit in SAMPLING_LIMITS.items():
        prop = chat.get(name) if name != "logprobs" else completion[name]
        assert prop is not None, name
        lo = prop["exclusiveMinimum"] if limit.lo_open else prop["minimum"]
        assert lo == limit.lo and prop.get("maximum") == limit.hi, (name, prop, limit)
    assert chat["top_logprobs"]["maximum"] == SAMPLING_LIMITS["logprobs"].hi
    assert chat["max_tokens"]["maximum"] == CONTEXT


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_the_schema_round_trips_every_documented_example(kind: str) -> None:
    from router.openai_types import ChatCompletionRequest, CompletionRequest

    model = ChatCompletionRequest if kind == "chat" else CompletionRequest
    schema = openapi_schema(CONTEXT)["components"]["schemas"][model.__name__]
    assert schema["examples"]
    for example in schema["examples"]:
        parsed = model.model_validate(example)
        known = {k: v for k, v in example.items() if k in model.model_fields}
        assert parsed.model_dump(exclude_unset=True) == known
        assert parse_request(kind, example, CONTEXT, "r").requests  # and the gateway serves it


def test_finish_reasons_round_trip_the_proto() -> None:
    for reason in FinishReason:
        assert finish_from_proto(finish_to_proto(reason.value)) == reason.value
    assert FinishReason("length") is FinishReason.LENGTH


def test_one_error_type_maps_to_both_transports() -> None:
    error = RequestError(Status.RESOURCE_EXHAUSTED, "full", retry_after_s=0.5)
    assert (error.status.grpc_name, error.status.http_status) == ("RESOURCE_EXHAUSTED", 429)
    import grpc

    assert all(hasattr(grpc.StatusCode, s.grpc_name) for s in Status)


def test_load_report_is_shared_by_the_state_schema() -> None:
    from tandem.state import schema

    assert schema.LoadReport is LoadReport


# --- generation defaults (the model's generation_config.json, then the server's overrides) ------

def test_sampling_defaults_come_from_generation_config_then_overrides() -> None:
    from tandem.protocol import SamplingDefaults

    config = {"temperature": 0.2, "top_p": 0.9, "eos_token_id": [2], "do_sample": True}
    defaults = SamplingDefaults.from_generation_config(config)
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_tokens) == (0.2, 0.9, -1, None)
    assert SamplingDefaults.from_generation_config(config, {"temperature": 0.7}).temperature == 0.7
    assert SamplingDefaults.from_generation_config({"max_new_tokens": 40}).max_tokens == 40
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingDefaults.from_generation_config({"temperature": 9.0})
    with pytest.raises(InvalidRequestError, match="unknown generation config key"):
        SamplingDefaults.from_generation_config({}, {"temprature": 0.1})


def test_requests_get_the_defaults_for_what_they_leave_out() -> None:
    from router.core import sampling_from_request
    from tandem.protocol import SamplingDefaults
    from tandem.rpc.v1 import common_pb2

    defaults = SamplingDefaults(temperature=0.2, top_p=0.9, max_tokens=40)
    left_out = parse_request("completion", {"prompt": "hi"}, CONTEXT, "r", defaults).requests[0].sampling
    assert (round(left_out.temperature, 6), round(left_out.top_p, 6), left_out.max_tokens) == (0.2, 0.9, 16)
    chat = parse_request("chat", {"messages": MESSAGES}, CONTEXT, "r", defaults).requests[0].sampling
    assert chat.max_tokens == 40  # the model's max_new_tokens, under the context
    given = parse_request("chat", {"messages": MESSAGES, "temperature": 1.5, "top_p": 1}, CONTEXT, "r",
                          defaults).requests[0].sampling
    assert (given.temperature, given.top_p) == (1.5, 1.0)
    # gRPC: proto3's 0 is "unset" for top_p and max_tokens; temperature 0 stays greedy as documented
    params = sampling_from_request(common_pb2.SamplingParams(), defaults)
    assert (params.temperature, round(params.top_p, 6), params.max_tokens) == (0.0, 0.9, 40)


def test_router_flag_overrides_the_model_generation_config(tmp_path: Any) -> None:
    import json

    from router.config import RouterConfig

    for name in ("config.json", "tokenizer.json"):
        (tmp_path / name).write_text("{}")
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.2, "top_p": 0.9}))

    def config(**kwargs: Any) -> RouterConfig:
        return RouterConfig(model_dir=tmp_path, host="127.0.0.1", grpc_port=0, prefill_addresses=("h:1",),
                            decode_addresses=("h:2",), redis_url="", cell_id="c", router_id="r",
                            stall_timeout_s=1, request_timeout_s=1, **kwargs)

    assert (config().sampling_defaults().temperature, config().sampling_defaults().top_p) == (0.2, 0.9)
    overridden = config(override_generation_config='{"temperature": 0.7}').sampling_defaults()
    assert (overridden.temperature, overridden.top_p) == (0.7, 0.9)
    assert config(generation_config="none").sampling_defaults().temperature == 1.0
    for bad in ('{"temperature": 5}', '[1]', '{"nope": 1}', "not json"):
        with pytest.raises(ValueError, match="override-generation-config"):
            config(override_generation_config=bad)


@given(st.one_of(st.none(), st.floats(0.0, 1e6)), st.lists(st.tuples(st.sampled_from(["a", "b", "x-retry"]),
                                                                     st.text(max_size=5)), max_size=3))
def test_a_retry_hint_survives_grpc_trailing_metadata(retry_after_s: float | None, others: list[tuple[str, str]]) -> None:
    """A dropped prompt's hint travels prefill_svc -> router as ``retry-after`` (milliseconds kept)."""
    metadata = [*others, *retry_after_metadata(retry_after_s)]
    got = retry_after_from(metadata)
    if retry_after_s is None:
        assert got is None
    else:
        assert got is not None and abs(got - retry_after_s) <= 0.0006
    assert retry_after_from([("retry-after", b"2.5")]) == 2.5  # grpc may give bytes
    for bad in ("soon", "-1", ""):
        assert retry_after_from([("retry-after", bad)]) is None
    assert retry_after_from(None) is None
