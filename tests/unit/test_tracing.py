"""Trace context across a real grpc.aio chain (client -> A -> B) and tracing setup from OTEL_*.

The in-process tests hand their own TracerProvider (with an in-memory exporter) to the
interceptors and never touch the global provider; ``setup_tracing``, which does, runs in
subprocesses.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import grpc.aio
import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tandem.rpc.tracing import (
    child_span,
    client_interceptors,
    extract_context,
    inject_metadata,
    server_interceptor,
    tracer,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")
RPC_TIMEOUT_S = 5.0


def _identity(payload: bytes) -> bytes:
    return payload


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


# --------------------------------------------------------------------------------------------
# A two-hop mesh without protos: bytes in, bytes out.
# --------------------------------------------------------------------------------------------


@dataclass
class Mesh:
    """Servers A and B in this process; A's handlers call B through a traced channel."""

    provider: SdkTracerProvider
    exporter: InMemorySpanExporter
    to_a: grpc.aio.Channel  # the test client's traced channel to A

    def unary(self, method: str) -> Any:
        return self.to_a.unary_unary(
            f"/test.A/{method}", request_serializer=_identity, response_deserializer=_identity
        )

    def stream(self, method: str) -> Any:
        return self.to_a.unary_stream(
            f"/test.A/{method}", request_serializer=_identity, response_deserializer=_identity
        )

    def root_span(self, name: str = "request") -> Any:
        return self.provider.get_tracer("test").start_as_current_span(name)

    async def spans(self, count: int) -> list[ReadableSpan]:
        """The finished spans, once there are ``count`` of them.

        Waits because a streaming CLIENT span ends from a watcher task, and a cancelled server
        handler ends its span only when grpc gets round to cancelling it.
        """
        for _ in range(200):
            spans = list(self.exporter.get_finished_spans())
            if len(spans) >= count:
                assert len(spans) == count, [s.name for s in spans]
                return spans
            await asyncio.sleep(0.01)
        raise AssertionError(f"wanted {count} spans, got {[s.name for s in spans]}")


def _handlers(
    service: str, methods: dict[str, tuple[str, Callable[..., Any]]]
) -> grpc.GenericRpcHandler:
    factories = {
        "unary": grpc.unary_unary_rpc_method_handler,
        "stream": grpc.unary_stream_rpc_method_handler,
    }
    return grpc.method_handlers_generic_handler(
        service,
        {
            name: factories[kind](
                behaviour, request_deserializer=_identity, response_serializer=_identity
            )
            for name, (kind, behaviour) in methods.items()
        },
    )


async def _start_server(
    generic_handler: grpc.GenericRpcHandler, provider: SdkTracerProvider
) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(interceptors=[server_interceptor(provider)])
    server.add_generic_rpc_handlers((generic_handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@asynccontextmanager
async def _mesh() -> AsyncIterator[Mesh]:
    exporter = InMemorySpanExporter()
    provider = SdkTracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return b"b:" + request

    handlers_b = _handlers("test.B", {"Echo": ("unary", echo)})
    server_b, address_b = await _start_server(handlers_b, provider)
    to_b = grpc.aio.insecure_channel(address_b, interceptors=client_interceptors(provider))
    b_echo = to_b.unary_unary(
        "/test.B/Echo", request_serializer=_identity, response_deserializer=_identity
    )

    async def relay(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        reply: bytes = await b_echo(request, timeout=RPC_TIMEOUT_S)
        return b"a:" + reply

    async def relay_stream(
        request: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        for i in range(2):
            yield await b_echo(request + str(i).encode(), timeout=RPC_TIMEOUT_S)

    async def relay_written(request: bytes, context: grpc.aio.ServicerContext) -> None:
        # The reader/writer API: a coroutine, not a generator; grpc drives the two differently.
        for i in range(2):
            await context.write(await b_echo(request + str(i).encode(), timeout=RPC_TIMEOUT_S))

    async def boom(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        raise ValueError("boom")

    async def boom_stream(
        request: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        yield b"first"
        raise ValueError("boom mid-stream")

    async def not_found(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await context.abort(grpc.StatusCode.NOT_FOUND, "no such request")
        raise AssertionError("abort returned")

    async def slow(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await asyncio.sleep(30)
        return b"too late"

    async def endless(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        while True:
            yield b"tick"
            await asyncio.sleep(0.01)

    handlers_a = _handlers(
        "test.A",
        {
            "Relay": ("unary", relay),
            "RelayStream": ("stream", relay_stream),
            "RelayWritten": ("stream", relay_written),
            "Boom": ("unary", boom),
            "BoomStream": ("stream", boom_stream),
            "NotFound": ("unary", not_found),
            "Slow": ("unary", slow),
            "Endless": ("stream", endless),
        },
    )
    server_a, address_a = await _start_server(handlers_a, provider)
    to_a = grpc.aio.insecure_channel(address_a, interceptors=client_interceptors(provider))
    try:
        yield Mesh(provider=provider, exporter=exporter, to_a=to_a)
    finally:
        await to_a.close()
        await to_b.close()
        await server_a.stop(None)
        await server_b.stop(None)


def _one(spans: list[ReadableSpan], name: str, kind: SpanKind) -> ReadableSpan:
    found = _all(spans, name, kind)
    assert len(found) == 1, (name, kind, [(s.name, s.kind) for s in spans])
    return found[0]


def _all(spans: list[ReadableSpan], name: str, kind: SpanKind) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name and s.kind == kind]


def _span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return span.context.span_id


def _trace_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return span.context.trace_id


def _parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def _assert_child(child: ReadableSpan, parent: ReadableSpan) -> None:
    assert _parent_id(child) == _span_id(parent), (child.name, parent.name)
    assert _trace_id(child) == _trace_id(parent)


def _status_code_attr(span: ReadableSpan) -> Any:
    assert span.attributes is not None
    return span.attributes["rpc.grpc.status_code"]


# --------------------------------------------------------------------------------------------
# Propagation through the chain
# --------------------------------------------------------------------------------------------


def test_unary_chain_is_one_trace_with_each_server_under_its_client() -> None:
    async def scenario() -> None:
        async with _mesh() as mesh:
            with mesh.root_span() as root:
                reply = await mesh.unary("Relay")(b"hi", timeout=RPC_TIMEOUT_S)
            assert reply == b"a:b:hi"
            spans = await mesh.spans(5)

        root_span = _one(spans, "request", SpanKind.INTERNAL)
        assert _span_id(root_span) == root.get_span_context().span_id
        client_a = _one(spans, "test.A/Relay", SpanKind.CLIENT)
        server_a = _one(spans, "test.A/Relay", SpanKind.SERVER)
        client_b = _one(spans, "test.B/Echo", SpanKind.CLIENT)
        server_b = _one(spans, "test.B/Echo", SpanKind.SERVER)
        _assert_child(client_a, root_span)
        _assert_child(server_a, client_a)
        _assert_child(client_b, server_a)
        _assert_child(server_b, client_b)
        assert server_a.parent is not None and server_a.parent.is_remote
        for span in (client_a, server_a, client_b, server_b):
            assert _status_code_attr(span) == grpc.StatusCode.OK.value[0]
            assert span.status.status_code == StatusCode.UNSET
        assert client_a.attributes is not None
        assert client_a.attributes["rpc.service"] == "test.A"
        assert client_a.attributes["rpc.method"] == "Relay"

    _run(scenario())


@pytest.mark.parametrize("method", ["RelayStream", "RelayWritten"])
def test_streaming_chain_is_one_trace_for_generator_and_writer_handlers(method: str) -> None:
    async def scenario() -> None:
        async with _mesh() as mesh:
            with mesh.root_span():
                call = mesh.stream(method)(b"x", timeout=RPC_TIMEOUT_S)
                replies = [reply async for reply in call]
                assert await call.code() == grpc.StatusCode.OK
            assert replies == [b"b:x0", b"b:x1"]
            spans = await mesh.spans(7)

        root_span = _one(spans, "request", SpanKind.INTERNAL)
        client_a = _one(spans, f"test.A/{method}", SpanKind.CLIENT)
        server_a = _one(spans, f"test.A/{method}", SpanKind.SERVER)
        _assert_child(client_a, root_span)
        _assert_child(server_a, client_a)
        clients_b = _all(spans, "test.B/Echo", SpanKind.CLIENT)
        servers_b = _all(spans, "test.B/Echo", SpanKind.SERVER)
        assert len(clients_b) == len(servers_b) == 2
        for client_b in clients_b:
            _assert_child(client_b, server_a)
        # Each hop's server span sits under its own client span, not under a sibling's.
        assert sorted(_parent_id(s) or 0 for s in servers_b) == sorted(
            _span_id(c) for c in clients_b
        )
        assert {_trace_id(s) for s in spans} == {_trace_id(root_span)}
        assert _status_code_attr(client_a) == grpc.StatusCode.OK.value[0]
        assert server_a.end_time is not None and client_a.end_time is not None

    _run(scenario())


def test_rpc_without_a_parent_starts_a_new_trace_at_the_client() -> None:
    async def scenario() -> None:
        async with _mesh() as mesh:
            assert await mesh.unary("Relay")(b"hi", timeout=RPC_TIMEOUT_S) == b"a:b:hi"
            spans = await mesh.spans(4)
        client_a = _one(spans, "test.A/Relay", SpanKind.CLIENT)
        assert client_a.parent is None
        assert {_trace_id(s) for s in spans} == {_trace_id(client_a)}

    _run(scenario())


def test_existing_metadata_is_kept_and_stale_traceparent_replaced() -> None:
    stale = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"

    async def scenario() -> None:
        async with _mesh() as mesh:
            with mesh.root_span():
                await mesh.unary("Relay")(
                    b"hi",
                    timeout=RPC_TIMEOUT_S,
                    metadata=(("traceparent", stale), ("x-request-id", "r-1")),
                )
            spans = await mesh.spans(5)
        server_a = _one(spans, "test.A/Relay", SpanKind.SERVER)
        _assert_child(server_a, _one(spans, "test.A/Relay", SpanKind.CLIENT))

    _run(scenario())


# --------------------------------------------------------------------------------------------
# Errors and cancellation
# --------------------------------------------------------------------------------------------


def test_handler_exception_marks_both_spans_error_and_client_gets_unknown() -> None:
    async def scenario() -> None:
        async with _mesh() as mesh:
            with mesh.root_span():
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await mesh.unary("Boom")(b"", timeout=RPC_TIMEOUT_S)
            assert raised.value.code() == grpc.StatusCode.UNKNOWN
            spans = await mesh.spans(3)

        server = _one(spans, "test.A/Boom", SpanKind.SERVER)
        client = _one(spans, "test.A/Boom", SpanKind.CLIENT)
        _assert_child(server, client)
        assert server.status.status_code == StatusCode.ERROR
        assert "boom" in (server.status.description or "")
        assert [e.name for e in server.events] == ["exception"]
        assert client.status.status_code == StatusCode.ERROR
        for span in (server, client):
            assert _status_code_attr(span) == grpc.StatusCode.UNKNOWN.value[0]

    _run(scenario())


def test_exception_in_a_stream_generator_marks_the_server_span_error() -> None:
    async def scenario() -> None:
        async with _mesh() as mesh:
            call = mesh.stream("BoomStream")(b"", timeout=RPC_TIMEOUT_S)
            received: list[bytes] = []
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                async for reply in call:
                    received.append(reply)
            assert received == [b"first"]
            assert raised.value.code() == grpc.StatusCode.UNKNOWN
            spans = await mesh.spans(2)

        server = _one(spans, "test.A/BoomStream", SpanKind.SERVER)
        client = _one(spans, "test.A/BoomStream", SpanKind.CLIENT)
        _assert_child(server, client)
        assert server.status.status_code == StatusCode.ERROR
        assert client.status.status_code == StatusCode.ERROR
        assert _status_code_attr(client) == grpc.StatusCode.UNKNOWN.value[0]

    _run(scenario())


def test_abort_keeps_its_code_and_is_not_a_server_fault() -> None:
    async def scenario() -> None:
        async with _mesh() as mesh:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await mesh.unary("NotFound")(b"", timeout=RPC_TIMEOUT_S)
            assert raised.value.code() == grpc.StatusCode.NOT_FOUND
            assert raised.value.details() == "no such request"
            spans = await mesh.spans(2)

        server = _one(spans, "test.A/NotFound", SpanKind.SERVER)
        client = _one(spans, "test.A/NotFound", SpanKind.CLIENT)
        assert _status_code_attr(server) == grpc.StatusCode.NOT_FOUND.value[0]
        assert server.status.status_code == StatusCode.UNSET
        assert server.events == ()
        assert client.status.status_code == StatusCode.ERROR
        assert "no such request" in (client.status.description or "")

    _run(scenario())


def test_cancelling_a_unary_call_cancels_the_rpc_and_ends_both_spans() -> None:
    async def scenario() -> None:
        async with _mesh() as mesh:
            call = mesh.unary("Slow")(b"", timeout=RPC_TIMEOUT_S)
            await asyncio.sleep(0.2)  # let the handler start
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            # The server span ends long before the handler's 30 s sleep only if the cancel
            # reached the server.
            spans = await mesh.spans(2)

        client = _one(spans, "test.A/Slow", SpanKind.CLIENT)
        server = _one(spans, "test.A/Slow", SpanKind.SERVER)
        assert _status_code_attr(client) == grpc.StatusCode.CANCELLED.value[0]
        assert _status_code_attr(server) == grpc.StatusCode.CANCELLED.value[0]

    _run(scenario())


def test_cancelling_a_stream_midway_ends_both_spans_cancelled() -> None:
    async def scenario() -> None:
        async with _mesh() as mesh:
            call = mesh.stream("Endless")(b"", timeout=RPC_TIMEOUT_S)
            assert await call.read() == b"tick"
            call.cancel()
            assert await call.code() == grpc.StatusCode.CANCELLED
            spans = await mesh.spans(2)

        client = _one(spans, "test.A/Endless", SpanKind.CLIENT)
        server = _one(spans, "test.A/Endless", SpanKind.SERVER)
        assert _status_code_attr(client) == grpc.StatusCode.CANCELLED.value[0]
        assert client.status.status_code == StatusCode.ERROR
        assert _status_code_attr(server) == grpc.StatusCode.CANCELLED.value[0]
        assert server.status.status_code == StatusCode.UNSET

    _run(scenario())


# --------------------------------------------------------------------------------------------
# Helpers for non-RPC hand-offs
# --------------------------------------------------------------------------------------------


@pytest.fixture
def provider_and_exporter() -> tuple[SdkTracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = SdkTracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def test_inject_without_a_span_adds_nothing() -> None:
    assert inject_metadata() == []
    assert inject_metadata([("x-request-id", "r-1")]) == [("x-request-id", "r-1")]


def test_queued_context_resumes_the_trace_under_the_explicit_parent(
    provider_and_exporter: tuple[SdkTracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = provider_and_exporter
    with tracer("test", provider).start_as_current_span("submit") as submit:
        queued = inject_metadata([("x-request-id", "r-1")])
        # Re-injecting (e.g. a retry) must not leave two traceparents behind.
        assert inject_metadata(queued) == queued
    assert [key for key, _ in queued].count("traceparent") == 1
    assert ("x-request-id", "r-1") in queued

    parent = extract_context(queued)
    remote = trace.get_current_span(parent).get_span_context()
    assert remote.is_remote
    assert remote.trace_id == submit.get_span_context().trace_id
    assert remote.span_id == submit.get_span_context().span_id

    # The scheduler loop has its own ambient span; the explicit parent must win over it.
    with tracer("test", provider).start_as_current_span("scheduler-loop"):
        with child_span("prefill-batch", parent, tracer_provider=provider) as span:
            assert trace.get_current_span() is span
    finished = {s.name: s for s in exporter.get_finished_spans()}
    _assert_child(finished["prefill-batch"], finished["submit"])


def test_child_span_records_an_escaping_exception(
    provider_and_exporter: tuple[SdkTracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = provider_and_exporter
    with pytest.raises(RuntimeError):
        with child_span("step", None, tracer_provider=provider):
            raise RuntimeError("device lost")
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code == StatusCode.ERROR
    assert span.parent is None


def test_extract_of_missing_or_malformed_metadata_has_no_span() -> None:
    for metadata in (None, [], [("traceparent", "not-a-traceparent")], [("k-bin", b"\x00")]):
        assert not trace.get_current_span(extract_context(metadata)).get_span_context().is_valid


# --------------------------------------------------------------------------------------------
# setup_tracing, in subprocesses: it sets process-global state.
# --------------------------------------------------------------------------------------------

_SETUP_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from opentelemetry import trace
    from tandem.rpc.tracing import setup_tracing, shutdown_tracing, tracer

    provider = setup_tracing("tandem-test")
    assert setup_tracing("someone-else") is provider
    assert trace.get_tracer_provider() is provider
    span_context = None
    if "--span" in sys.argv:
        with tracer("test").start_as_current_span("hello-span") as span:
            span_context = span.get_span_context()
    shutdown_tracing()
    shutdown_tracing()
    print(json.dumps({
        "trace_id": format(span_context.trace_id, "032x") if span_context else None,
        "resource": dict(provider.resource.attributes),
        "otlp_loaded": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter" in sys.modules,
    }))
    """
)


def _run_setup(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    clean["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT)] + ([clean["PYTHONPATH"]] if "PYTHONPATH" in clean else [])
    )
    return subprocess.run(
        [sys.executable, "-c", _SETUP_SCRIPT, *args],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def _report(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert result.returncode == 0, result.stderr
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def test_console_exporter_writes_the_span_to_stderr() -> None:
    result = _run_setup({"OTEL_TRACES_EXPORTER": "console"}, "--span")
    report = _report(result)
    exported = json.loads(result.stderr)
    assert exported["name"] == "hello-span"
    assert exported["context"]["trace_id"] == "0x" + report["trace_id"]
    assert exported["resource"]["attributes"]["service.name"] == "tandem-test"
    assert not report["otlp_loaded"]


@pytest.mark.parametrize("exporter", [None, "none"])
def test_none_exports_nothing_but_spans_still_get_ids(exporter: str | None) -> None:
    result = _run_setup({"OTEL_TRACES_EXPORTER": exporter} if exporter else {}, "--span")
    report = _report(result)
    assert result.stderr == ""
    assert int(report["trace_id"], 16) != 0
    assert not report["otlp_loaded"]


def test_env_names_the_service_and_adds_resource_attributes() -> None:
    attrs = "deployment.environment=ci,service.name=from-attrs"
    report = _report(_run_setup({"OTEL_RESOURCE_ATTRIBUTES": attrs}))
    assert report["resource"]["service.name"] == "from-attrs"
    assert report["resource"]["deployment.environment"] == "ci"

    report = _report(
        _run_setup({"OTEL_RESOURCE_ATTRIBUTES": attrs, "OTEL_SERVICE_NAME": "override"})
    )
    assert report["resource"]["service.name"] == "override"


def test_otlp_is_imported_only_when_asked_for() -> None:
    # Nothing is exported (no span), so the unreachable endpoint is never dialled.
    env = {
        "OTEL_TRACES_EXPORTER": " otlp , console ",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
    }
    assert _report(_run_setup(env))["otlp_loaded"]


def test_unknown_exporter_fails_loudly() -> None:
    result = _run_setup({"OTEL_TRACES_EXPORTER": "zipkin"})
    assert result.returncode != 0
    assert "zipkin" in result.stderr and "ValueError" in result.stderr


def test_prefill_scopes_a_request_trace_context_and_restores_the_callers() -> None:
    """prefill_svc runs each request's agent RPCs under that request's trace context and gives
    the caller's context back afterwards, also when the work raises (no attach without detach)."""
    from prefill_svc.server import _in_trace

    key = otel_context.create_key("tandem-test")
    theirs = otel_context.set_value(key, "request", otel_context.get_current())

    class Pending:
        trace_context = theirs

    before = otel_context.get_current()
    with _in_trace(Pending()):  # type: ignore[arg-type]
        assert otel_context.get_value(key) == "request"
    assert otel_context.get_current() == before
    with pytest.raises(RuntimeError), _in_trace(Pending()):  # type: ignore[arg-type]
        raise RuntimeError("boom")
    assert otel_context.get_current() == before and otel_context.get_value(key) is None
