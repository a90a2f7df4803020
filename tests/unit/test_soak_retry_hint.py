"""bench/soak.py's workers wait a refusal's Retry-After before their next request, faults or
not, as a client that honours the hint does: the hint rides in the outcome's text after the part
the soak counts by, from HTTP's ``retry-after-ms`` (else ``Retry-After``) or gRPC's trailing
``retry-after``, bounded as ``tandem bench`` bounds it."""

from __future__ import annotations

import importlib
import random

import httpx

from tandem.bench.client import RETRY_AFTER_MAX_S, RETRY_AFTER_MIN_S


def test_a_refusals_hint_rides_in_its_outcome_and_is_read_back_bounded() -> None:
    soak = importlib.import_module("bench.soak")
    rng = random.Random(3)
    for _ in range(200):
        hint_ms = rng.choice([0, 1, rng.randint(2, 20_000), 60_000])
        headers = rng.choice([{"retry-after-ms": str(hint_ms), "retry-after": "30"},
                              {"retry-after": str(hint_ms // 1000)}, {}, {"retry-after": "soon"}])
        outcome = soak._refused(httpx.Response(429, headers=headers))
        assert outcome.split(":")[0] == "http 429"  # what the soak counts
        hint = soak._retry_hint_s(outcome)
        if "retry-after-ms" in headers:
            sent = hint_ms / 1000
        elif headers.get("retry-after", "").isdigit():
            sent = hint_ms // 1000
        else:
            assert hint is None and outcome == "http 429"
            continue
        assert hint is not None and abs(hint - min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, sent))) < 1e-3
    assert soak._refused(httpx.Response(400)) == "http 400" and soak._retry_hint_s("http 400") is None
    grpc_outcome = soak._with_hint("grpc RESOURCE_EXHAUSTED", 0.25)
    assert grpc_outcome.split(":")[0] == "grpc RESOURCE_EXHAUSTED" and soak._retry_hint_s(grpc_outcome) == 0.25
    assert soak._with_hint("grpc RESOURCE_EXHAUSTED", None) == "grpc RESOURCE_EXHAUSTED"
    assert soak._retry_hint_s("failed clearly: http 503 retry after 2 s") is None  # only a refusal's hint
