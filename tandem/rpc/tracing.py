"""Distributed tracing for Tandem's gRPC mesh: one trace from router through prefill to decode.

Two halves:

- ``setup_tracing`` installs the process-wide OpenTelemetry tracer provider from the *standard*
  ``OTEL_*`` environment variables (no ``TANDEM_*`` twins: collectors and operators already speak
  these names).
- ``client_interceptors`` / ``server_interceptor`` carry the W3C trace context (``traceparent``,
  ``tracestate``, ``baggage``) in gRPC metadata through the global propagator, open a CLIENT span
  per outgoing RPC and a SERVER span per incoming RPC, and record the gRPC status code on both.

For hand-offs that are not RPCs (a request parked in a queue, a task spawned later),
``inject_metadata`` / ``extract_context`` serialise the context into the same ``(key, value)``
pairs, and ``child_span`` opens a span under an explicit parent instead of the ambient one.

Span status follows the OpenTelemetry gRPC conventions: a CLIENT span is ERROR for every non-OK
code; a SERVER span is ERROR only for codes that mean the server failed (UNKNOWN, INTERNAL, ...),
so an expected ``RESOURCE_EXHAUSTED`` from admission control does not light up as a server error.

Why the interceptors are ours and not ``opentelemetry-instrumentation-grpc``'s: that package's
grpc.aio interceptors (0.66b2, the release matching our SDK 1.45), run against this module's
unit tests (tests/unit/test_tracing.py, same mesh, same assertions modulo a leading ``/`` in span
names), fail 6 of 15 (measured 2026-11-24):

- a unary-stream handler written with ``context.write`` (the router's public ``Generate``) fails
  every call with ``TypeError: 'async for' requires an object with __aiter__ method`` — a known,
  open bug (open-telemetry/opentelemetry-python-contrib#3066); tracing would break the service;
- a cancelled unary call ends neither span, and a stream cancelled midway never ends its CLIENT
  span (its wrapper only ends the span when the caller iterates to the end);
- a handler's exception leaves the SERVER span's status UNSET, and ``context.abort`` records
  exception events on it.

The span names, attributes and status rules here follow the same semantic conventions, so moving
to the package once those are fixed changes no dashboard; the test file is the check to rerun.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import sys
import threading
from collections.abc import (
    AsyncGenerator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Sequence,
)
from contextlib import contextmanager
from typing import Any

import grpc
import grpc.aio
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
)
from opentelemetry.trace import Span, SpanKind, Tracer, TracerProvider
from opentelemetry.trace.status import Status, StatusCode

__all__ = [
    "child_span",
    "client_interceptors",
    "extract_context",
    "inject_metadata",
    "server_interceptor",
    "setup_tracing",
    "shutdown_tracing",
    "tracer",
]

# Instrumentation scope of the spans the interceptors open.
_SCOPE = "tandem.rpc"

_EXPORTERS_ENV = "OTEL_TRACES_EXPORTER"
_KNOWN_EXPORTERS = ("none", "console", "otlp")

# Server-side codes that mean "the server failed" (OpenTelemetry gRPC semantic conventions);
# every other non-OK code is the caller's problem and leaves a SERVER span's status unset.
_SERVER_ERROR_CODES = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)

_setup_lock = threading.Lock()
_provider: SdkTracerProvider | None = None
_shut_down = False


# --------------------------------------------------------------------------------------------
# Provider setup
# --------------------------------------------------------------------------------------------


def _exporter_names(raw: str | None) -> list[str]:
    """Parse ``OTEL_TRACES_EXPORTER``: a comma-separated list; unset or empty means ``none``.

    Raises ValueError on a name we cannot honour, because a typo would otherwise silently drop
    every span of the process.
    """
    names = [name.strip().lower() for name in (raw or "").split(",") if name.strip()]
    unknown = [name for name in names if name not in _KNOWN_EXPORTERS]
    if unknown:
        raise ValueError(
            f"{_EXPORTERS_ENV}={raw!r}: unknown exporter(s) {unknown}; "
            f"expected a comma-separated subset of {list(_KNOWN_EXPORTERS)}"
        )
    return [name for name in names if name != "none"]


def _span_processor(exporter_name: str) -> SpanProcessor:
    if exporter_name == "console":
        # Simple (synchronous) export: console output is for humans debugging one process, who
        # want the span the moment it ends, not a batch later.
        return SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stderr))
    # Imported here so processes that never export over OTLP do not pay for (or depend on) the
    # exporter's protobuf/grpc modules. It reads OTEL_EXPORTER_OTLP_* itself.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return BatchSpanProcessor(OTLPSpanExporter())


def setup_tracing(service_name: str) -> SdkTracerProvider:
    """Install and return the process-wide tracer provider, configured from the environment.

    - ``OTEL_TRACES_EXPORTER``: comma-separated ``none`` | ``console`` | ``otlp``. Unset means
      ``none`` (deliberately unlike the SDK's ``otlp`` default, so a dev box without a
      collector does not log export failures). With ``none`` spans are still recorded and carry
      real trace/span ids, so context still propagates to services that do export.
      ``console`` prints finished spans as JSON to stderr; ``otlp`` ships them in batches to
      ``OTEL_EXPORTER_OTLP_ENDPOINT`` (and the other ``OTEL_EXPORTER_OTLP_*`` variables).
    - ``OTEL_SERVICE_NAME``, or ``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES``, overrides
      ``service_name``; the other ``OTEL_RESOURCE_ATTRIBUTES`` become resource attributes.
    - ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` are honoured by the SDK itself.

    Idempotent: the first call in a process wins and later calls return the same provider,
    whatever ``service_name`` they pass (OpenTelemetry allows the global provider to be set once).

    Raises:
        ValueError: ``OTEL_TRACES_EXPORTER`` names an exporter other than the three above. The
            global provider is left untouched in that case.
    """
    global _provider
    with _setup_lock:
        if _provider is not None:
            return _provider
        exporter_names = _exporter_names(os.environ.get(_EXPORTERS_ENV))
        # The env detector is what Resource.create consults too; asking it first lets the
        # environment beat the code's default name instead of the other way round.
        env_service_name = OTELResourceDetector().detect().attributes.get(SERVICE_NAME)
        resource = Resource.create({SERVICE_NAME: str(env_service_name or service_name)})
        provider = SdkTracerProvider(resource=resource)
        for name in exporter_names:
            provider.add_span_processor(_span_processor(name))
        trace.set_tracer_provider(provider)
        _provider = provider
        return provider


def shutdown_tracing() -> None:
    """Flush every pending span and shut the provider from ``setup_tracing`` down.

    Call it once on graceful exit, after the gRPC server has stopped, so the last spans reach the
    exporter. A no-op if ``setup_tracing`` was never called or this already ran. Tracing stays
    off for the rest of the process: the global provider cannot be replaced.
    """
    global _shut_down
    with _setup_lock:
        if _provider is None or _shut_down:
            return
        _shut_down = True
        _provider.force_flush()
        _provider.shutdown()


def tracer(name: str, tracer_provider: TracerProvider | None = None) -> Tracer:
    """A tracer for instrumentation scope ``name`` (by convention the module's ``__name__``).

    Uses ``tracer_provider`` if given, else the global one; before ``setup_tracing`` the global
    provider is a proxy, so module-level tracers created at import time start working once setup
    runs.
    """
    return trace.get_tracer(name, tracer_provider=tracer_provider)


# --------------------------------------------------------------------------------------------
# Context in metadata
# --------------------------------------------------------------------------------------------


def _injected_pairs(context: Context | None) -> dict[str, str]:
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return carrier


def inject_metadata(
    metadata: Sequence[tuple[str, str]] | None = None, context: Context | None = None
) -> list[tuple[str, str]]:
    """Return ``metadata`` plus the propagation headers of ``context`` (default: the current one).

    The result is a new list; ``metadata`` is not modified. Entries whose keys the propagator
    writes now (``traceparent``, ...) are replaced rather than duplicated, so re-injecting into
    metadata that already carries an older context is safe. With no active span nothing is added.
    """
    injected = _injected_pairs(context)
    kept = [(key, value) for key, value in (metadata or ()) if key.lower() not in injected]
    return kept + list(injected.items())


def extract_context(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context:
    """The context carried by ``metadata`` (as written by ``inject_metadata`` or an interceptor).

    Accepts gRPC invocation metadata as is (binary ``-bin`` values are ignored). Starts from an
    empty context, not the current one: missing or malformed headers give a context without a
    span, under which a new span becomes the root of a new trace.
    """
    carrier: dict[str, list[str]] = {}
    for key, value in metadata or ():
        if isinstance(value, str):
            carrier.setdefault(key.lower(), []).append(value)
    return propagate.extract(carrier)


@contextmanager
def child_span(
    name: str,
    parent: Context | None,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: dict[str, str | int | float | bool] | None = None,
    tracer_provider: TracerProvider | None = None,
) -> Iterator[Span]:
    """Run the ``with`` block inside a new current span whose parent comes from ``parent``.

    For work resumed away from the code that caused it, e.g. a scheduler loop serving a request
    that was queued with ``inject_metadata()`` pairs: pass ``extract_context(pairs)`` so the span
    joins the request's trace instead of the loop's. ``parent=None`` means the current context.
    An exception leaving the block is recorded and sets the span's status to ERROR.
    """
    with tracer(_SCOPE, tracer_provider).start_as_current_span(
        name, context=parent, kind=kind, attributes=attributes
    ) as span:
        yield span


# --------------------------------------------------------------------------------------------
# Span bookkeeping shared by both sides
# --------------------------------------------------------------------------------------------


def _rpc_attributes(full_method: str) -> tuple[str, dict[str, str]]:
    """Span name (``tandem.v1.Prefill/Submit``) and rpc.* attributes of ``/pkg.Service/Method``."""
    name = full_method.lstrip("/")
    service, _, method = name.rpartition("/")
    return name, {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}


def _end_span(span: Span, code: grpc.StatusCode, details: str | None, *, is_error: bool) -> None:
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if is_error:
        description = f"{code.name}: {details}" if details else code.name
        span.set_status(Status(StatusCode.ERROR, description))
    span.end()


def _end_client_span(span: Span, code: grpc.StatusCode, details: str | None) -> None:
    _end_span(span, code, details, is_error=code != grpc.StatusCode.OK)


def _end_server_span(span: Span, code: grpc.StatusCode, details: str | None) -> None:
    _end_span(span, code, details, is_error=code in _SERVER_ERROR_CODES)


# --------------------------------------------------------------------------------------------
# Client side
# --------------------------------------------------------------------------------------------


class _ClientSpans:
    """What both client interceptors share: the tracer, span start, and metadata injection."""

    def __init__(self, tracer_provider: TracerProvider | None) -> None:
        self._tracer = tracer(_SCOPE, tracer_provider)

    def start(self, client_call_details: Any) -> tuple[Span, Any]:
        """Open the CLIENT span under the current context and return the details to send.

        The current context is the caller's: grpc.aio runs interceptors in a task created when
        the stub is called, and a task starts from a copy of its creator's contextvars.
        """
        method = client_call_details.method
        if isinstance(method, bytes):
            method = method.decode()
        name, attributes = _rpc_attributes(method)
        span = self._tracer.start_span(name, kind=SpanKind.CLIENT, attributes=attributes)
        injected = _injected_pairs(trace.set_span_in_context(span))
        pairs: list[tuple[str, str | bytes]] = [
            (key, value)
            for key, value in (client_call_details.metadata or ())
            if key not in injected
        ]
        pairs.extend(injected.items())
        details = client_call_details._replace(metadata=grpc.aio.Metadata(*pairs))
        return span, details


class _UnaryUnaryClientTracing(grpc.aio.UnaryUnaryClientInterceptor):
    """CLIENT span for unary-unary RPCs; ends when the status is known, before the caller resumes.

    Waits for the RPC's status inside the interceptor so the span covers the whole call and is
    finished by the time ``await stub.Method(...)`` returns. Side effect: the caller's
    ``initial_metadata()`` also resolves only once the call completes.
    """

    def __init__(self, spans: _ClientSpans) -> None:
        self._spans = spans

    async def intercept_unary_unary(
        self,
        continuation: Callable[[Any, Any], Awaitable[Any]],
        client_call_details: Any,
        request: Any,
    ) -> Any:
        span, details = self._spans.start(client_call_details)
        call: Any = None
        try:
            call = await continuation(details, request)
            code = await call.code()
            rpc_details = await call.details()
        except asyncio.CancelledError:
            # The caller cancelled while we were waiting on the status: grpc.aio cancels only
            # this interceptor task, so the RPC itself must be cancelled here or it runs on.
            if call is not None:
                call.cancel()
            _end_client_span(span, grpc.StatusCode.CANCELLED, "cancelled by the caller")
            raise
        except grpc.aio.AioRpcError as exc:
            _end_client_span(span, exc.code(), exc.details())
            raise
        except BaseException as exc:
            span.record_exception(exc)
            _end_client_span(span, grpc.StatusCode.UNKNOWN, repr(exc))
            raise
        _end_client_span(span, code, rpc_details)
        return call


class _UnaryStreamClientTracing(grpc.aio.UnaryStreamClientInterceptor):
    """CLIENT span for unary-stream RPCs; ends when the stream's status arrives.

    Returns the call untouched (so ``read()``, ``async for`` and ``cancel()`` behave exactly as
    without tracing) and watches its status from a small task. The span therefore ends however
    the caller consumes the stream, including never, or by cancelling it; the price is that it
    may end an event-loop step after the caller sees the end of the stream.
    """

    def __init__(self, spans: _ClientSpans) -> None:
        self._spans = spans
        # Strong references: the loop keeps only weak ones, and a collected watcher would leave
        # its span open forever.
        self._watchers: set[asyncio.Task[None]] = set()

    async def intercept_unary_stream(
        self,
        continuation: Callable[[Any, Any], Awaitable[Any]],
        client_call_details: Any,
        request: Any,
    ) -> Any:
        span, details = self._spans.start(client_call_details)
        try:
            call = await continuation(details, request)
        except grpc.aio.AioRpcError as exc:
            _end_client_span(span, exc.code(), exc.details())
            raise
        except asyncio.CancelledError:
            _end_client_span(span, grpc.StatusCode.CANCELLED, "cancelled by the caller")
            raise
        except BaseException as exc:
            span.record_exception(exc)
            _end_client_span(span, grpc.StatusCode.UNKNOWN, repr(exc))
            raise
        watcher = asyncio.get_running_loop().create_task(_end_span_on_status(span, call))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        return call


async def _end_span_on_status(span: Span, call: Any) -> None:
    """End ``span`` with ``call``'s final status; ends it without one if the wait is cut short."""
    try:
        code = await call.code()
        rpc_details = await call.details()
    except BaseException:
        # Loop shutdown cancelled us: an ended span with no status beats a span that is lost.
        span.end()
        raise
    _end_client_span(span, code, rpc_details)


def client_interceptors(
    tracer_provider: TracerProvider | None = None,
) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for ``grpc.aio.insecure_channel(target, interceptors=...)``.

    Each unary-unary and unary-stream call gets a CLIENT span named ``package.Service/Method``,
    child of the context current where the stub is called, with ``rpc.grpc.status_code`` set and
    status ERROR for non-OK codes; the span's context travels in the call's metadata. Spans come
    from ``tracer_provider``, default the global one. Stream-request RPCs pass through untraced:
    Tandem has none, and waiting for their status inside an interceptor would deadlock callers
    that use ``call.write()``.

    One object per arity is required: grpc.aio files each interceptor under the *first*
    interceptor interface it implements, so a single class implementing both would only ever
    see unary-unary calls.
    """
    spans = _ClientSpans(tracer_provider)
    return [_UnaryUnaryClientTracing(spans), _UnaryStreamClientTracing(spans)]


# --------------------------------------------------------------------------------------------
# Server side
# --------------------------------------------------------------------------------------------


class _ServerSpan:
    """One RPC's SERVER span, and the context its handler runs in."""

    def __init__(self, tracer_: Tracer, full_method: str, parent: Context) -> None:
        name, attributes = _rpc_attributes(full_method)
        self.span = tracer_.start_span(
            name, context=parent, kind=SpanKind.SERVER, attributes=attributes
        )
        # Built on the extracted context, not the current one, so the caller's baggage reaches
        # the handler too.
        self.context = trace.set_span_in_context(self.span, parent)

    def end_ok(self, servicer_context: Any) -> None:
        # A handler may set a non-OK code and return normally instead of aborting.
        code = servicer_context.code() or grpc.StatusCode.OK
        _end_server_span(self.span, code, servicer_context.details())

    def end_with(self, exc: BaseException, servicer_context: Any) -> None:
        if isinstance(exc, grpc.aio.AbortError):
            # context.abort() already chose the status; the exception is just its transport.
            code = servicer_context.code() or grpc.StatusCode.UNKNOWN
            _end_server_span(self.span, code, servicer_context.details())
        elif isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
            # The client went away or the server is stopping; neither is a handler failure.
            _end_server_span(self.span, grpc.StatusCode.CANCELLED, None)
        else:
            # grpc.aio turns any other exception into UNKNOWN for the client.
            self.span.record_exception(exc)
            _end_server_span(self.span, grpc.StatusCode.UNKNOWN, f"{type(exc).__name__}: {exc}")


_Behaviour = Callable[[Any, Any], Any]


def _traced_coroutine(
    behaviour: Callable[[Any, Any], Awaitable[Any]],
    open_span: Callable[[], _ServerSpan],
) -> Callable[[Any, Any], Awaitable[Any]]:
    """Wrap a coroutine behaviour (unary response, or a stream written via ``context.write``)."""

    async def traced(request: Any, servicer_context: Any) -> Any:
        server_span = open_span()
        token = otel_context.attach(server_span.context)
        try:
            response = await behaviour(request, servicer_context)
        except BaseException as exc:
            server_span.end_with(exc, servicer_context)
            # Bare raise: grpc.aio checks that the AbortError it sees is the very object that
            # context.abort() raised.
            raise
        finally:
            otel_context.detach(token)
        server_span.end_ok(servicer_context)
        return response

    return traced


def _traced_async_generator(
    behaviour: Callable[[Any, Any], AsyncGenerator[Any, None]],
    open_span: Callable[[], _ServerSpan],
) -> Callable[[Any, Any], AsyncGenerator[Any, None]]:
    """Wrap an async-generator behaviour (a stream produced with ``yield``).

    The span's context is attached around each step of the inner generator and detached before
    every ``yield``, never held across one: the server may stop iterating at a yield (client
    gone) and the generator is then closed later from another context, where detaching a token
    attached here would fail.
    """

    async def traced(request: Any, servicer_context: Any) -> AsyncGenerator[Any, None]:
        server_span = open_span()
        responses = behaviour(request, servicer_context)
        try:
            while True:
                token = otel_context.attach(server_span.context)
                try:
                    response = await responses.__anext__()
                except StopAsyncIteration:
                    break
                finally:
                    otel_context.detach(token)
                yield response
        except BaseException as exc:
            server_span.end_with(exc, servicer_context)
            token = otel_context.attach(server_span.context)
            try:
                # Run the handler's own cleanup now rather than whenever it is collected.
                await responses.aclose()
            finally:
                otel_context.detach(token)
            raise
        server_span.end_ok(servicer_context)

    return traced


class _ServerTracing(grpc.aio.ServerInterceptor):
    """Runs each async handler inside a SERVER span joined to the caller's trace."""

    def __init__(self, tracer_provider: TracerProvider | None) -> None:
        self._tracer = tracer(_SCOPE, tracer_provider)

    async def intercept_service(
        self,
        continuation: Callable[[Any], Awaitable[Any]],
        handler_call_details: Any,
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method: str = handler_call_details.method
        metadata = handler_call_details.invocation_metadata

        def open_span() -> _ServerSpan:
            # Opened when the handler starts, not here: the span should time the handler, not
            # the request's wait for deserialisation.
            return _ServerSpan(self._tracer, method, extract_context(metadata))

        # grpc.aio picks how to drive a behaviour from its function kind (coroutine function vs
        # async generator function vs plain function), so each wrapper must keep the kind of
        # what it wraps; the four arities only differ in the factory that rebuilds the handler.
        arities: list[tuple[_Behaviour | None, Callable[..., Any]]] = [
            (handler.unary_unary, grpc.unary_unary_rpc_method_handler),
            (handler.unary_stream, grpc.unary_stream_rpc_method_handler),
            (handler.stream_unary, grpc.stream_unary_rpc_method_handler),
            (handler.stream_stream, grpc.stream_stream_rpc_method_handler),
        ]
        for behaviour, make_handler in arities:
            if behaviour is None:
                continue
            traced: _Behaviour
            if inspect.isasyncgenfunction(behaviour):
                traced = _traced_async_generator(behaviour, open_span)
            elif inspect.iscoroutinefunction(behaviour):
                traced = _traced_coroutine(behaviour, open_span)
            else:
                # Synchronous handlers run on grpc's thread pool; wrapping them in a coroutine
                # would move them onto the event loop, so they pass through untraced.
                return handler
            return make_handler(
                traced,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


def server_interceptor(tracer_provider: TracerProvider | None = None) -> grpc.aio.ServerInterceptor:
    """Interceptor for ``grpc.aio.server(interceptors=[...])``.

    Every async handler (coroutine or async generator, any arity) runs inside a SERVER span
    named ``package.Service/Method`` whose parent is the context in the request's metadata (a
    new trace if there is none). The span is current inside the handler, so its outgoing RPCs
    through ``client_interceptors`` and its ``child_span``/``tracer`` spans join the trace. The
    span records ``rpc.grpc.status_code`` (from ``context.abort``/``set_code``; UNKNOWN for an
    escaping exception, which is also recorded as an event) and is ERROR for server-fault codes.
    Synchronous handlers pass through untraced. Spans come from ``tracer_provider``, default
    the global one.
    """
    return _ServerTracing(tracer_provider)


# --------------------------------------------------------------------------------------------
# What the services install
# --------------------------------------------------------------------------------------------


def tracing_enabled() -> bool:
    """Whether this process exports spans (``OTEL_TRACES_EXPORTER`` names an exporter)."""
    return bool(_exporter_names(os.environ.get(_EXPORTERS_ENV)))


def service_server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """The server interceptors a Tandem process installs: tracing only when spans are exported.

    With no exporter nobody reads the spans, and the interceptors would cost every metadata RPC
    (allocate, extend, handoff) about 0.1 ms on each side for nothing.
    """
    return [server_interceptor()] if tracing_enabled() else []


def service_client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """Client-side twin of ``service_server_interceptors``."""
    return client_interceptors() if tracing_enabled() else []
