"""The public gRPC API (``tandem.v1.Router``): a thin adapter over the models' ``RouterCore`` s.

``Generate`` streams what the core yields and turns a ``RequestError`` into the call's status
(with ``retry-after`` trailing metadata when admission gave a hint, as the SDK reads it). A
resend of a request refused here (the SDK's, saying so in ``tandem-retry-count``) is admitted
against the deadline of its first send, as over HTTP (``router.retries``). A
stopping router's calls still in flight end UNAVAILABLE with a message (``router.in_flight``).
Bytes that are not a ``GenerateRequest`` never reach this module: see ``router.wire_errors``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import grpc.aio

from router.models import ServedModels
from router.retries import RefusedRequests, retry_key
from tandem.protocol import RequestError, Status
from tandem.rpc.convert import RETRY_COUNT_KEY, retry_after_metadata
from tandem.rpc.v1 import router_pb2, router_pb2_grpc


def grpc_status(error: RequestError) -> grpc.StatusCode:
    status: grpc.StatusCode = getattr(grpc.StatusCode, error.status.grpc_name)
    return status


GENERATE_PATH = "/tandem.v1.Router/Generate"


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Generate / ListModels / Health for the router's models (one core each, by ``model``)."""

    def __init__(self, models: ServedModels) -> None:
        self._models = models
        self._refused = RefusedRequests()  # the first sends of requests refused lately, for their resends

    async def Generate(self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        """Stream the request's tokens and text; statuses as ``RouterCore.generate`` documents."""
        received_ns = time.monotonic_ns()
        metadata = {key: value for key, value in context.invocation_metadata() or ()}
        # the request's bytes and digest only for a resend's lookup or a refusal (most requests need neither)
        authorization = str(metadata.get("authorization", ""))
        key = lambda: retry_key(GENERATE_PATH, authorization, request.SerializeToString(deterministic=True))
        retry_count = metadata.get(RETRY_COUNT_KEY)
        first_sent_ns = self._refused.first_sent_ns(key, None if retry_count is None else str(retry_count), received_ns)
        error: RequestError | None = None
        with self._models.in_flight.running():
            try:
                core = self._models.pick(request.model)
                async with contextlib.aclosing(core.generate(request, context.time_remaining(), received_ns=received_ns,
                                                             first_sent_ns=first_sent_ns)) as stream:
                    async for response in stream:
                        await context.write(response)
            except RequestError as exc:
                error = exc
                if exc.status is Status.RESOURCE_EXHAUSTED:
                    self._refused.refused(key(), first_sent_ns, time.monotonic_ns())
            except asyncio.CancelledError:
                if (error := self._models.in_flight.ended()) is None:
                    raise  # the client cancelled
        if error is not None:  # outside the try: abort raises
            await context.abort(grpc_status(error), error.message,
                                trailing_metadata=retry_after_metadata(error.retry_after_s))

    async def ListModels(self, request: router_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> router_pb2.ListModelsReply:
        return router_pb2.ListModelsReply(models=[
            router_pb2.ModelInfo(id=core.model_id, max_context=core.context_length) for core in self._models])

    async def Health(self, request: router_pb2.HealthRequest,
                     context: grpc.aio.ServicerContext) -> router_pb2.HealthReply:
        """Live always; ready when a prefill and a decode service are reachable (the tokenizer is
        loaded before the server starts, so a servicer that answers has one)."""
        readiness = await self._models.readiness()
        names = ", ".join(self._models.names)
        detail = f"model {names}; {readiness.detail}" if readiness.ready else readiness.detail
        return router_pb2.HealthReply(live=True, ready=readiness.ready, detail=detail)
