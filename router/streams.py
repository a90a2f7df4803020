"""The decode-stream demultiplexer.

Each decode service sends this router one ``TokenBatch`` per decode step over one long-lived
``Decode.Stream``; the batch mixes the updates of every request of this router that the step
advanced. ``DecodeStreams`` keeps one such stream open per decode address and routes each
``TokenUpdate`` to the queue of its request.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

import grpc
import grpc.aio

from tandem.rpc.channels import ChannelPool
from tandem.rpc.v1 import common_pb2, decode_pb2, decode_pb2_grpc

log = logging.getLogger("tandem.router.streams")

# Called with (decode address, request id) for an update nobody waits for.
OrphanCallback = Callable[[str, str], None]


class DecodeStreams:
    """Demultiplexes the decode services' token streams into one queue per request.

    Contract:
    - ``register`` before the request can produce tokens (before ``Prefill.Submit``), so no
      update is missed; every update for a registered id is put on its queue in stream order;
    - updates for unregistered ids are dropped; for one that is not a final update,
      ``on_orphan`` is called once per id (the router cancels it: some decode service is
      spending steps and KV blocks on a request nobody reads);
    - a stream that fails or ends is reopened after a backoff (doubling from
      ``reconnect_initial_s`` up to ``reconnect_max_s``) until ``close`` or until its address
      is removed by ``set_addresses``; requests are not told, their stall timeout covers a
      decode service that does not come back; ``open_addresses`` names the streams open now
      (the router's readiness: a decode service whose stream is not open cannot deliver);
    - every (re)open names the registered requests whose final update has not arrived, with
      the tokens received of each (``awaiting``): what a stream wrote but never delivered
      before it broke, or before its decode service died, is sent again (a decode service
      marks a request done once its end is written to the stream), and ``stall_timeout_s``:
      decode names the requests it holds without stepping them (waiting for KV blocks) in
      updates without tokens, several times within it; such an update reaches the request's
      queue and counts as no tokens received.
    The object keeps a reference to every task it starts; ``close`` cancels and awaits them.
    """

    # Orphan ids remembered, so a runaway request is cancelled once and not once per step.
    MAX_REMEMBERED_ORPHANS = 4096
    # Longest wait between tries of a decode service never reached yet (it is starting).
    STARTING_RETRY_MAX_S = 0.2

    def __init__(
        self,
        router_id: str,
        channels: ChannelPool,
        *,
        on_orphan: OrphanCallback | None = None,
        reconnect_initial_s: float = 0.05,
        reconnect_max_s: float = 0.25,
        stall_timeout_s: float = 0.0,
    ) -> None:
        self._router_id = router_id
        self._stall_timeout_s = stall_timeout_s  # told to each stream, for decode's notices of held requests
        self._channels = channels
        self._on_orphan = on_orphan
        self._reconnect_initial_s = reconnect_initial_s
        self._reconnect_max_s = reconnect_max_s
        self._queues: dict[str, asyncio.Queue[decode_pb2.TokenUpdate]] = {}
        self._ended: set[str] = set()  # registered ids whose final update has been dispatched
        self._received: dict[str, int] = {}  # registered id -> output tokens dispatched (up to)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._retired: set[asyncio.Task[None]] = set()
        self._orphans: OrderedDict[str, None] = OrderedDict()
        self._num_batches: dict[str, int] = {}
        self._open: set[str] = set()  # addresses whose stream is open now (its first batch came)
        self._closed = False
        # When a stream last opened (its first batch came; ``time.monotonic``): a stream's gap
        # that spans it spans an outage (a decode service restarted and resumed its requests),
        # not a step, and the stream cap leaves it out.
        self.last_opened_s = -math.inf

    @property
    def addresses(self) -> tuple[str, ...]:
        """Decode addresses with a stream task, in the order they were added."""
        return tuple(self._tasks)

    @property
    def open_addresses(self) -> tuple[str, ...]:
        """Decode addresses whose stream is open now: their tokens reach this router."""
        return tuple(a for a in self._tasks if a in self._open)

    @property
    def num_registered(self) -> int:
        return len(self._queues)

    def num_batches(self, address: str) -> int:
        """Batches received from ``address`` since it was added (for health and tests)."""
        return self._num_batches.get(address, 0)

    def set_addresses(self, addresses: Iterable[str]) -> None:
        """Follow exactly ``addresses``: open streams to new ones, stop those no longer listed."""
        if self._closed:
            raise RuntimeError("DecodeStreams is closed")
        wanted = list(dict.fromkeys(addresses))
        for address in list(self._tasks):
            if address not in wanted:
                task = self._tasks.pop(address)
                task.cancel()
                # Keep the task referenced until its cancellation has run.
                self._retired.add(task)
                task.add_done_callback(self._retired.discard)
                self._num_batches.pop(address, None)
                self._open.discard(address)
        for address in wanted:
            if address not in self._tasks:
                self._tasks[address] = asyncio.get_running_loop().create_task(
                    self._follow(address), name=f"decode-stream {address}"
                )

    def register(self, request_id: str) -> asyncio.Queue[decode_pb2.TokenUpdate]:
        """A new queue receiving ``request_id``'s updates; ValueError if the id is in use."""
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in flight")
        queue: asyncio.Queue[decode_pb2.TokenUpdate] = asyncio.Queue()
        self._queues[request_id] = queue
        # A reused id is not an orphan any more.
        self._orphans.pop(request_id, None)
        return queue

    def unregister(self, request_id: str) -> None:
        """Stop routing ``request_id``'s updates (idempotent)."""
        self._queues.pop(request_id, None)
        self._ended.discard(request_id)
        self._received.pop(request_id, None)

    def awaiting(self) -> list[decode_pb2.StreamOffset]:
        """The registered requests whose final update has not arrived, with the output tokens
        received of each (told to a stream when it opens)."""
        return [decode_pb2.StreamOffset(request_id=rid, num_tokens=self._received.get(rid, 0))
                for rid in self._queues if rid not in self._ended]

    async def close(self) -> None:
        """Cancel every stream task and wait until they are gone."""
        self._closed = True
        tasks = [*self._tasks.values(), *self._retired]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def dispatch(self, address: str, batch: decode_pb2.TokenBatch) -> None:
        """Route one batch's updates (public so that a test can drive it without a stream)."""
        self._num_batches[address] = self._num_batches.get(address, 0) + 1
        for update in batch.updates:
            queue = self._queues.get(update.request_id)
            if queue is not None:
                queue.put_nowait(update)
                end = update.first_index + len(update.tokens)
                # (a notice without tokens says nothing of what arrived: see DecodeWorker._notice_held)
                if update.tokens and end > self._received.get(update.request_id, 0):
                    self._received[update.request_id] = end
                if update.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    self._ended.add(update.request_id)
            elif update.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
                self._note_orphan(address, update.request_id)

    def _note_orphan(self, address: str, request_id: str) -> None:
        if self._on_orphan is None or request_id in self._orphans:
            return
        self._orphans[request_id] = None
        if len(self._orphans) > self.MAX_REMEMBERED_ORPHANS:
            self._orphans.popitem(last=False)
        self._on_orphan(address, request_id)

    async def _follow(self, address: str) -> None:
        loop = asyncio.get_running_loop()
        delay_s = self._reconnect_initial_s
        num_failures = 0
        connected = False  # ever: a router starts beside its services, before they serve
        while True:
            opened_s = loop.time()
            stub = decode_pb2_grpc.DecodeStub(self._channels.get(address))
            # The one RPC without a deadline: the stream lives as long as the process. A hung
            # decode service is caught per request by the router's stall timeout.
            call = stub.Stream(decode_pb2.StreamRequest(router_id=self._router_id, awaiting=self.awaiting(),
                                                        stall_timeout_s=self._stall_timeout_s))
            try:
                async for batch in call:
                    if address not in self._open:
                        self.last_opened_s = time.monotonic()
                    self._open.add(address)
                    if num_failures:
                        log.info("decode stream from %s is %s", address, "back" if connected else "open")
                        num_failures = 0
                    connected = True
                    self.dispatch(address, batch)
                reason = "ended"
            except grpc.aio.AioRpcError as exc:
                reason = f"failed ({exc.code().name}: {exc.details()})"
            except Exception:  # a bug in dispatch must not end the stream for good
                log.exception("decode stream from %s: unexpected error", address)
                reason = "failed (unexpected error)"
            finally:
                call.cancel()
                if self._tasks.get(address) in (None, asyncio.current_task()):  # not a successor's
                    self._open.discard(address)
            num_failures += 1
            if not connected:  # not an outage: the decode service is still starting
                log.log(logging.INFO if num_failures == 1 else logging.DEBUG,
                        "decode service at %s not serving yet; connecting", address)
            else:  # warn once per outage, not once per retry while a decode service is down
                log.log(logging.WARNING if num_failures == 1 else logging.DEBUG,
                        "decode stream from %s %s; reconnecting", address, reason)
            if loop.time() - opened_s > self._reconnect_max_s:
                delay_s = self._reconnect_initial_s  # it was up for a while: a fresh outage
            await asyncio.sleep(delay_s)
            # A decode service still starting is tried often: the stack serves once this opens.
            delay_s = min(delay_s * 2, self._reconnect_max_s if connected else self.STARTING_RETRY_MAX_S)
