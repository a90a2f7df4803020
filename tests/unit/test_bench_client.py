"""The bench client against an in-process fake server (httpx.MockTransport): token counting per
chunk, errors as records, scheduling of concurrency and sessions, deterministic prompts."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tandem.bench.client import (
    RETRY_AFTER_MAX_S,
    RETRY_AFTER_MIN_S,
    PromptBuilder,
    RunResult,
    Target,
    _retry_after_s,
    run_workload,
)
from tandem.bench.metrics import RequestRecord
from tandem.bench.workload import RequestSpec


def _sse(*payloads: dict[str, Any] | str) -> bytes:
    return b"".join(f"data: {p if isinstance(p, str) else json.dumps(p)}\n\n".encode() for p in payloads)


class FakeServer:
    """Answers by the request's max_tokens: 429 for 99, a cut stream for 98, else a stream whose
    first chunk holds two tokens (logprobs), then one text chunk, one empty chunk, usage = max_tokens."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.delay_s = delay_s
        self.in_flight = 0
        self.max_in_flight = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        n = body["max_tokens"]
        if n == 99:
            return httpx.Response(429, json={"error": {"message": "the queue is full", "type": "overloaded"}})
        if n == 97:
            raise httpx.ConnectError("connection refused")
        two = {"choices": [{"index": 0, "text": "ab", "logprobs": {"tokens": ["a", "b"]}}], "usage": None}
        one = {"choices": [{"index": 0, "text": "c", "logprobs": None}], "usage": None}
        empty = {"choices": [{"index": 0, "text": "", "logprobs": None}], "usage": None}
        usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}}
        if n == 98:
            return httpx.Response(200, content=_sse(two))
        return httpx.Response(200, content=_sse(two, one, empty, usage, "[DONE]"),
                              headers={"content-type": "text/event-stream"})


def _run(server: FakeServer, specs: list[RequestSpec], concurrency: int | None = None,
         endpoint: str = "completions") -> RunResult:
    target = Target("fake", "http://fake", endpoint)
    builder = PromptBuilder(0, token_ids=list(range(100, 200)))
    prompts = [builder.prompt(s) for s in specs]
    return asyncio.run(run_workload(target, "m", specs, prompts, concurrency=concurrency,
                                    transport=httpx.MockTransport(server)))


def test_tokens_per_chunk_usage_and_the_request_body() -> None:
    server = FakeServer()
    result = _run(server, [RequestSpec("r0", 0.0, 5, 4), RequestSpec("r1", 0.0, 6, 3)])
    r0, r1 = result.records
    assert r0.ok and r0.output_len == 4  # 2 (logprobs) + 1 (text) + 0 (empty) + 1 more said by usage
    assert r0.token_times_s[0] == r0.token_times_s[1] and r0.token_times_s == tuple(sorted(r0.token_times_s))
    assert r1.ok and r1.output_len == 3  # usage says 3: nothing added
    body = server.bodies[0]
    assert body["max_tokens"] == 4 and body["ignore_eos"] is True and body["temperature"] == 0.0
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["logprobs"] == 0 and body["model"] == "m"
    assert len(body["prompt"]) == 5 and all(100 <= t < 200 for t in body["prompt"])
    assert result.duration_s > 0


def test_failures_are_records_not_crashes() -> None:
    result = _run(FakeServer(), [RequestSpec("busy", 0.0, 5, 99), RequestSpec("cut", 0.0, 5, 98),
                                 RequestSpec("down", 0.0, 5, 97), RequestSpec("fine", 0.0, 5, 2)])
    busy, cut, down, fine = result.records
    assert not busy.ok and busy.error == "HTTP 429: the queue is full"
    assert not cut.ok and "[DONE]" in (cut.error or "") and cut.output_len == 2  # tokens kept
    assert not down.ok and (down.error or "").startswith("ConnectError")
    assert fine.ok


def test_fixed_concurrency_caps_requests_in_flight() -> None:
    server = FakeServer(delay_s=0.02)
    result = _run(server, [RequestSpec(f"r{i}", 0.0, 4, 2) for i in range(6)], concurrency=2)
    assert server.max_in_flight == 2 and all(r.ok for r in result.records)
    unbounded = FakeServer(delay_s=0.02)
    _run(unbounded, [RequestSpec(f"r{i}", 0.0, 4, 2) for i in range(6)])
    assert unbounded.max_in_flight == 6


def test_a_session_turn_waits_for_the_previous_turn_and_arrivals_are_kept() -> None:
    server = FakeServer(delay_s=0.05)
    specs = [RequestSpec("t0", 0.0, 8, 2, session_id=0), RequestSpec("t1", 0.01, 12, 2, session_id=0, shared_prefix_len=10),
             RequestSpec("x", 0.1, 4, 2)]
    t0, t1, x = _run(server, specs).records
    assert t0.finish_s is not None and t1.arrival_s >= t0.finish_s
    assert x.arrival_s >= 0.1 - 1e-3
    assert server.bodies[1]["prompt"][:8] == server.bodies[0]["prompt"]


def test_chat_body_and_text_prompts() -> None:
    server = FakeServer()
    specs = [RequestSpec("r0", 0.0, 7, 2)]
    target = Target("fake", "http://fake", "chat")
    builder = PromptBuilder(0)
    asyncio.run(run_workload(target, "m", specs, [builder.prompt(specs[0])], transport=httpx.MockTransport(server)))
    body = server.bodies[0]
    assert body["logprobs"] is True and body["top_logprobs"] == 0
    assert len(body["messages"][0]["content"].split()) == 7


def test_response_format_reaches_every_request(tmp_path: Any) -> None:
    from tandem.bench.cli import response_format_from

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    (tmp_path / "thing.json").write_text(json.dumps(schema))
    from_file = response_format_from(f"@{tmp_path / 'thing.json'}")
    assert from_file == {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}}
    assert response_format_from('{"type": "json_object"}') == {"type": "json_object"}
    assert response_format_from(None) is None
    for bad in ('{"type": "xml"}', "[1]", "{nope", f"@{tmp_path / 'missing.json'}"):
        with pytest.raises(ValueError, match="--response-format"):
            response_format_from(bad)
    server = FakeServer()
    specs = [RequestSpec("r0", 0.0, 7, 2), RequestSpec("r1", 0.0, 5, 2)]
    for endpoint in ("chat", "completions"):
        target = Target("fake", "http://fake", endpoint, response_format=from_file)
        builder = PromptBuilder(0)
        asyncio.run(run_workload(target, "m", specs, [builder.prompt(s) for s in specs],
                                 transport=httpx.MockTransport(server)))
    assert len(server.bodies) == 4 and all(body["response_format"] == from_file for body in server.bodies)


def test_prompts_are_deterministic_and_sessions_share_prefixes_in_any_order() -> None:
    turns = [RequestSpec("a", 0.0, 300, 5, 3, 0), RequestSpec("b", 1.0, 700, 5, 3, 305)]
    forward = PromptBuilder(5, token_ids=list(range(50000)))
    backward = PromptBuilder(5, token_ids=list(range(50000)))
    first, second = forward.prompt(turns[0]), forward.prompt(turns[1])
    assert backward.prompt(turns[1]) == second and backward.prompt(turns[0]) == first
    assert isinstance(first, list) and isinstance(second, list)
    assert len(first) == 300 and len(second) == 700 and second[:300] == first
    single = RequestSpec("c", 0.0, 300, 5)
    assert forward.prompt(single) != first  # unrelated requests do not share a prefix
    assert PromptBuilder(6, token_ids=list(range(50000))).prompt(single) != forward.prompt(single)
    assert forward.salted("load1").prompt(single) != forward.prompt(single)  # a fresh prompt per rate
    assert forward.salted("load1").prompt(single) == backward.salted("load1").prompt(single)


class RefusingServer(FakeServer):
    """Refuses each request's first ``refusals[request]`` attempts with 429 and a Retry-After."""

    def __init__(self, refusals: dict[int, int], retry_after_s: float, retry_after_ms: int | None = None) -> None:
        super().__init__()
        self.refusals = dict(refusals)
        self.retry_after_s = retry_after_s
        self.retry_after_ms = retry_after_ms  # also sent as OpenAI's retry-after-ms when set
        self.attempts: dict[int, int] = {}
        self.retry_counts: dict[int, list[str | None]] = {}  # each attempt's x-stainless-retry-count

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        key = body["max_tokens"]  # each request of the test has its own
        self.attempts[key] = self.attempts.get(key, 0) + 1
        self.retry_counts.setdefault(key, []).append(request.headers.get("x-stainless-retry-count"))
        if self.refusals.get(key, 0) >= self.attempts[key]:
            headers = {"retry-after": f"{self.retry_after_s:.2f}"}
            if self.retry_after_ms is not None:
                headers["retry-after-ms"] = str(self.retry_after_ms)
            return httpx.Response(429, json={"error": {"message": "admission refused: busy"}}, headers=headers)
        return await super().__call__(request)


def test_refused_requests_retry_after_the_servers_hint_and_keep_their_first_send() -> None:
    import random

    rng = random.Random(4)
    for _ in range(6):
        retries = rng.randint(0, 3)
        refusals = {n: rng.randint(0, 3) for n in range(2, 8)}  # max_tokens 2..7: one request each
        server = RefusingServer(refusals, retry_after_s=0.05)
        specs = [RequestSpec(f"r{n}", 0.0, 5, n) for n in refusals]
        target = Target("fake", "http://fake", "completions", retries_429=retries)
        builder = PromptBuilder(0, token_ids=list(range(100, 200)))
        result = asyncio.run(run_workload(target, "m", specs, [builder.prompt(s) for s in specs],
                                          concurrency=rng.choice([None, 2]), transport=httpx.MockTransport(server)))
        for spec, record in zip(specs, result.records, strict=True):
            refused = refusals[spec.output_len]
            assert server.attempts[spec.output_len] == min(refused, retries) + 1
            # each attempt counted as the openai client counts it, so a router knows a retry
            assert server.retry_counts[spec.output_len] == [str(n) for n in range(min(refused, retries) + 1)]
            assert record.num_429 == min(refused, retries)  # the refusals it was retried after
            assert RequestRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record
            if refused > retries:
                assert not record.ok and record.error is not None and record.error.startswith("HTTP 429")
            else:
                assert record.ok and record.output_len == spec.output_len
                ttft = record.ttft_s
                assert ttft is not None and ttft >= 0.05 * refused - 1e-3  # the waits count
                attempt_ttft = record.as_last_attempt().ttft_s  # from the last send: the waits do not
                assert attempt_ttft is not None and 0 <= attempt_ttft <= ttft - 0.05 * refused + 1e-3
            # the last attempt's send: none without a retry, after every wait with one
            if record.num_429:
                assert record.last_sent_s is not None
                assert record.last_sent_s >= record.arrival_s + 0.05 * record.num_429 - 1e-3
            else:
                assert record.last_sent_s is None and record.as_last_attempt() is record


def test_a_retry_follows_retry_after_ms_before_retry_after_as_the_openai_client_does() -> None:
    import random

    rng = random.Random(5)
    refusals = {n: rng.randint(1, 2) for n in range(2, 6)}
    server = RefusingServer(refusals, retry_after_s=30.0, retry_after_ms=rng.randint(20, 80))
    specs = [RequestSpec(f"r{n}", 0.0, 5, n) for n in refusals]
    target = Target("fake", "http://fake", "completions", retries_429=2)
    builder = PromptBuilder(0, token_ids=list(range(100, 200)))
    result = asyncio.run(run_workload(target, "m", specs, [builder.prompt(s) for s in specs],
                                      transport=httpx.MockTransport(server)))
    for spec, record in zip(specs, result.records, strict=True):
        assert record.ok and server.attempts[spec.output_len] == refusals[spec.output_len] + 1
        ttft = record.ttft_s  # the waits were the milliseconds', not Retry-After's 30 s
        assert ttft is not None and server.retry_after_ms / 1000 * refusals[spec.output_len] - 1e-3 <= ttft < 30


@pytest.mark.parametrize(("headers", "wait_s"), [
    ({"retry-after-ms": "250", "retry-after": "1"}, 0.25),
    ({"retry-after-ms": "soon", "retry-after": "2"}, 2.0),  # unusable ms: the seconds
    ({"retry-after": "0.5"}, 0.5),
    ({}, 1.0),
    ({"retry-after-ms": "0"}, RETRY_AFTER_MIN_S),
    ({"retry-after": "3600"}, RETRY_AFTER_MAX_S),
])
def test_the_retry_wait_read_from_a_refusal(headers: dict[str, str], wait_s: float) -> None:
    assert _retry_after_s(httpx.Response(429, headers=headers)) == pytest.approx(wait_s)


def test_retries_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="retries_429"):
        Target("fake", "http://fake", retries_429=-1)
