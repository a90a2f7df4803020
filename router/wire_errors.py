"""Requests that are not valid protobuf end with INVALID_ARGUMENT, naming what is wrong.

grpc.aio deserializes a request before any handler or interceptor code runs, and a
``DecodeError`` there (a string field holding invalid UTF-8, a truncated or garbage frame) ends
the call with UNKNOWN "Unexpected <class DecodeError>" and a server-side traceback: the client
cannot tell its own bad bytes from a server bug. ``MalformedRequestInterceptor`` swaps each
unary-request handler's deserializer for one that returns an ``Undecodable`` in place of
raising, and the handler for one that answers an ``Undecodable`` with INVALID_ARGUMENT before
the servicer sees it. For invalid UTF-8 the message names the field (protobuf's own error does
not): the frame is re-read with a twin of the message type whose strings are bytes.

Install it after the API-key interceptor, so that an unauthenticated caller still gets
UNAUTHENTICATED whatever it sent. Request-streaming handlers are left as they are.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import grpc
import grpc.aio
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, FileDescriptor
from google.protobuf.message import DecodeError, Message

_STRING = FieldDescriptor.TYPE_STRING
_BYTES = FieldDescriptor.TYPE_BYTES
_MESSAGE = FieldDescriptor.TYPE_MESSAGE


@dataclass(frozen=True)
class Undecodable:
    """What the tolerant deserializer returns for bytes that are not a valid request."""

    message: str  # for the client: what is wrong, and where when known


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Answers a request that does not deserialize with INVALID_ARGUMENT (see the module doc)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        behavior_name = "unary_stream" if handler.response_streaming else "unary_unary"
        behavior = getattr(handler, behavior_name)
        return handler._replace(**{  # type: ignore[attr-defined]  # grpc's handlers are namedtuples
            "request_deserializer": _tolerant(handler.request_deserializer),
            behavior_name: _refusing_undecodable(behavior),
        })


def _tolerant(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except (DecodeError, RecursionError) as exc:
            return Undecodable(_describe(deserializer, data, exc))

    return deserialize


def _refusing_undecodable(behavior: Callable[..., Any]) -> Callable[..., Any]:
    """``behavior`` of the same kind (coroutine or async generator), refusing an Undecodable."""

    async def refuse(request: Undecodable, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)

    if inspect.isasyncgenfunction(behavior):
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, Undecodable):
                await refuse(request, context)
            async for response in behavior(request, context):
                yield response

        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            await refuse(request, context)
        return await behavior(request, context)

    return unary


def _describe(deserializer: Callable[[bytes], Any], data: bytes, exc: BaseException) -> str:
    """The client's message: the type expected, the field with invalid UTF-8 when that is
    the problem (found by ``invalid_utf8_field``), else protobuf's own reason."""
    message_type = getattr(deserializer, "__self__", None)  # the generated stubs pass Type.FromString
    descriptor = getattr(message_type, "DESCRIPTOR", None)
    if not isinstance(descriptor, Descriptor):
        return f"the request is not a valid protobuf message: {exc}"
    where = f"the request is not a valid {descriptor.full_name}"
    field = invalid_utf8_field(descriptor, data)
    if field is not None:
        return f"{where}: field {field} is not valid UTF-8 (protobuf strings must be UTF-8 text)"
    reason = str(exc).rsplit(": ", 1)[-1] if isinstance(exc, DecodeError) else "it nests too deeply"
    return f"{where}: {reason[:1].lower()}{reason[1:]}"


def invalid_utf8_field(descriptor: Descriptor, data: bytes) -> str | None:
    """The path (``messages.messages[1].content``) of the first string field of ``data`` whose
    value is not UTF-8, read as a ``descriptor`` message; None when there is none, or when
    ``data`` is not a valid message for other reasons."""
    try:
        twin = _bytes_twin(descriptor)()
        twin.ParseFromString(data)
    except (DecodeError, RecursionError):
        return None
    return _first_invalid(descriptor, twin, "")


def _first_invalid(descriptor: Descriptor, twin: Message, prefix: str) -> str | None:
    for twin_field, value in twin.ListFields():
        field = descriptor.fields_by_number[twin_field.number]
        path = f"{prefix}{field.name}"
        repeated = field.is_repeated
        values = list(value) if repeated else [value]
        for i, item in enumerate(values):
            where = f"{path}[{i}]" if repeated else path
            if field.type == _STRING:
                try:
                    item.decode("utf-8")
                except UnicodeDecodeError:
                    return where
            elif field.type == _MESSAGE and not field.message_type.GetOptions().map_entry:
                found = _first_invalid(field.message_type, item, f"{where}.")
                if found is not None:
                    return found
    return None


@lru_cache(maxsize=32)
def _bytes_twin(descriptor: Descriptor) -> type[Message]:
    """A message class with ``descriptor``'s wire format whose string fields are bytes (which
    take any bytes), built in a pool of its own from copies of the message's .proto files."""
    pool = descriptor_pool.DescriptorPool()
    for file in _with_dependencies(descriptor.file):
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        pending = list(proto.message_type)
        while pending:
            message = pending.pop()
            pending.extend(message.nested_type)
            for field in message.field:
                # a map's key cannot be bytes: it stays a string (its entry's field 1)
                if field.type == _STRING and not (message.options.map_entry and field.number == 1):
                    field.type = _BYTES
        pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(descriptor.full_name))


def _with_dependencies(file: FileDescriptor) -> list[FileDescriptor]:
    """``file`` and every file it imports, each after its imports."""
    ordered: list[FileDescriptor] = []

    def visit(f: FileDescriptor) -> None:
        if f in ordered:
            return
        for dependency in f.dependencies:
            visit(dependency)
        ordered.append(f)

    visit(file)
    return ordered
