"""The torch-free protocol module: one set of sampling limits, read alike by the engine's
validator, the OpenAI parser and the OpenAPI schema; the router process imports no torch."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from router.http import HTTPError, openapi_schema, parse_request
from tandem.engine.errors import InvalidRequestError
from tandem.protocol import SAMPLING_LIMITS, FinishReason, LoadReport, RequestError, SamplingParams, Status
from tandem.rpc.convert import finish_from_proto, finish_to_proto

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
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    schema = openapi_schema(CONTEXT)["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    properties: dict[str, Any] = schema["properties"]
    return properties


def _edges(name: str) -> tuple[list[float], list[float]]:
    """Values the schema admits and values it refuses, at the edges of its range for ``name``."""
    prop = _schema_properties("chat")[name]
    lo, hi = prop["minimum"], prop.get("maximum")
    inside = [lo + 1e-3, (lo + hi) / 2 if hi is not None else lo + 1]
    outside = [lo - 1e-3]
    if hi is not None:
        inside.append(hi)
        outside.append(hi + 1e-3)
    if prop.get("exclusiveMinimum"):
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
        assert prop["minimum"] == limit.lo and prop.get("maximum") == limit.hi, (name, prop, limit)
    assert chat["top_logprobs"]["maximum"] == SAMPLING_LIMITS["logprobs"].hi


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
