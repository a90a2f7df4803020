"""The router's side of the mesh: where prefill and decode services are, and the calls to them.

``Upstream`` is what the core asks of the services behind it: pick a prefill service, submit
a prepared request to it (waiting up to ``wait_s``, ``--upstream-wait-s``, for one that is
restarting; a call its prefill service's death broke raises ``PrefillLost``),
receive the request's decode updates (``streams``), cancel it everywhere, and say whether a
prefill and a decode service are reachable. Every failure is a ``RequestError``: the core
never sees a gRPC status. Discovery (``UpstreamSource``) tells it the addresses.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, NamedTuple, Protocol

import grpc
import grpc.aio

from router.config import DEFAULT_UPSTREAM_WAIT_S
from router.streams import DecodeStreams
from tandem.protocol import RequestError, SamplingParams, Status
from tandem.rpc.channels import ChannelPool, connection_broke
from tandem.rpc.convert import retry_after_from, sampling_to_proto
from tandem.rpc.v1 import decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tandem.service.registry import ServiceLister, addresses_by_role

log = logging.getLogger("tandem.router")

# How long a readiness probe waits for an upstream channel to connect.
HEALTH_PROBE_TIMEOUT_S = 1.0
PROBE_PAUSE_S = 0.05  # between await_serving's calls that broke
# The connection states pick_prefill ranks the prefill services by.
_READY, _FAILING = grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE


# --- discovery ---------------------------------------------------------------------------------

class Upstreams(NamedTuple):
    """Where the prefill and decode services listen (host:port each)."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]


class UpstreamSource(Protocol):
    """Tells the router its upstreams; ``fetch`` is called at start and then periodically."""

    async def fetch(self) -> Upstreams: ...


class StaticUpstreams:
    """The addresses given on the command line."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str]) -> None:
        self._upstreams = Upstreams(tuple(prefill), tuple(decode))

    async def fetch(self) -> Upstreams:
        return self._upstreams


class RegistryUpstreams:
    """Live prefill and decode services of one cell (every cell when ``cell_id`` is empty), of one
    model when ``model`` is given."""

    def __init__(self, lister: ServiceLister, cell_id: str, model: str | None = None) -> None:
        self._lister = lister
        self._cell_id = cell_id or None
        self._model = model  # only the services computing this model (None: any)

    async def fetch(self) -> Upstreams:
        found = await addresses_by_role(self._lister, self._cell_id, self._model)
        return Upstreams(found.get("prefill", ()), found.get("decode", ()))


# --- calls -------------------------------------------------------------------------------------

class PrefillLost(RequestError):
    """A Submit that the prefill service's death, stop or lost connection broke off, not an
    answer of the service: the prompt may be sent again (the client has seen nothing of it).
    ``reached``: the call was sent on a connected channel (a service that is not back within the
    wait raises it with False: sending again would wait for nothing)."""

    def __init__(self, message: str, reached: bool) -> None:
        super().__init__(Status.UNAVAILABLE, message)
        self.reached = reached


class Readiness(NamedTuple):
    ready: bool
    detail: str  # names the upstream addresses, or what is missing


class Upstream:
    """The prefill and decode services this router sends work to.

    Owns the decode-stream demultiplexer and the background cancel tasks; the channels belong
    to the caller. ``close`` waits for pending cancels and closes the streams.
    """

    def __init__(self, router_id: str, channels: ChannelPool, cancel_timeout_s: float,
                 stall_timeout_s: float = 0.0, wait_s: float = DEFAULT_UPSTREAM_WAIT_S) -> None:
        self._router_id = router_id
        self._wait_s = wait_s
        self._known = asyncio.Event()  # set while a prefill and a decode service are known
        self._channels = channels
        self._cancel_timeout_s = cancel_timeout_s
        self.streams = DecodeStreams(router_id, channels, on_orphan=self._cancel_orphan,
                                     stall_timeout_s=stall_timeout_s)
        self._prefill_addresses: tuple[str, ...] = ()
        self._next_prefill = itertools.count()
        self._background: set[asyncio.Task[None]] = set()

    @property
    def knows_both(self) -> bool:
        """Whether a prefill and a decode service are known (from the flags or the registry):
        without, ``pick_prefill`` waits for them, then refuses."""
        return bool(self._prefill_addresses and self.streams.addresses)

    def set_upstreams(self, upstreams: Upstreams) -> None:
        if upstreams.prefill != self._prefill_addresses or upstreams.decode != self.streams.addresses:
            log.info("upstreams: prefill %s, decode %s",
                     ", ".join(upstreams.prefill) or "none", ", ".join(upstreams.decode) or "none")
        if len(upstreams.prefill) > 1:
            for address in set(upstreams.prefill) - set(self._prefill_addresses):
                # connect now, so that pick_prefill knows whether it serves before a request needs it
                self._channels.get(address).get_state(try_to_connect=True)
        self._prefill_addresses = upstreams.prefill
        self.streams.set_addresses(upstreams.decode)
        if self.knows_both:
            self._known.set()
        else:
            self._known.clear()

    async def close(self, timeout_s: float = 5.0) -> None:
        """Wait (up to ``timeout_s``) for pending upstream cancels, then stop the streams."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout_s)
        await self.streams.close()

    async def pick_prefill(self, deadline_s: float, avoid: str = "") -> str:
        """A prefill address, round robin over those whose connection is ready, else over those
        whose connection is not failing (all of them when every one is), and other than
        ``avoid`` (the one a resend's call broke on) when there is another: a dead prefill_svc
        among live ones, still listed for its registration's lifetime or given by flag, took
        every other request into the wait for it to come back, and one newly listed was not yet
        known to fail (its connection still being tried). While no prefill or no decode service
        is known (the registry lists a restarting service again only once it serves) it waits
        for both, up to ``wait_s`` and the deadline (loop time); UNAVAILABLE when they do not
        come."""
        if not self.knows_both:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._wait_bound_s(deadline_s)):
                    await self._known.wait()
        addresses: Sequence[str] = self._prefill_addresses
        if not addresses:
            raise RequestError(Status.UNAVAILABLE, "no prefill service is known to this router")
        if not self.streams.addresses:
            raise RequestError(Status.UNAVAILABLE, "no decode service is known to this router")
        if len(addresses) > 1:
            others = [a for a in addresses if a != avoid] or list(addresses)
            states = [self._channels.get(a).get_state(try_to_connect=True) for a in others]
            addresses = [a for a, state in zip(others, states, strict=True) if state == _READY] \
                or [a for a, state in zip(others, states, strict=True) if state != _FAILING] or others
        return addresses[next(self._next_prefill) % len(addresses)]

    def _wait_bound_s(self, deadline_s: float) -> float:
        """How long a request may wait for an upstream: ``wait_s``, within its deadline (loop time)."""
        return min(self._wait_s, max(deadline_s - asyncio.get_running_loop().time(), 0))

    async def submit(self, address: str, upstream_id: str, prompt_ids: list[int], params: SamplingParams,
                     arrival_unix_ns: int, deadline_s: float) -> prefill_pb2.PrefillReply:
        """``Prefill.Submit``: the reply carries the first token. ``deadline_s`` is loop time.
        PrefillLost when the call broke off rather than had the service's answer."""
        channel = self._channels.get(address)
        reached = True
        if channel.get_state(try_to_connect=True) != grpc.ChannelConnectivity.READY:
            # A prefill_svc that is restarting is back within seconds: wait for it a little
            # rather than fail the request at once.
            try:
                async with asyncio.timeout(self._wait_bound_s(deadline_s)):
                    await channel.channel_ready()
            except TimeoutError:
                reached = False
        timeout_s = deadline_s - asyncio.get_running_loop().time()
        stub = prefill_pb2_grpc.PrefillStub(channel)
        message = prefill_pb2.PrefillRequest(
            request_id=upstream_id, token_ids=prompt_ids, sampling=sampling_to_proto(params),
            router_id=self._router_id, arrival_unix_ns=arrival_unix_ns,
        )
        try:
            reply: prefill_pb2.PrefillReply = await stub.Submit(message, timeout=max(timeout_s, 0.001))
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise RequestError(Status.DEADLINE_EXCEEDED,
                                   f"prefill did not answer within the request's {timeout_s:.3g}s") from None
            # The client can act on these as they are: fix the request, or retry later.
            if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED):
                # A dropped prompt's retry hint goes on to the client (Retry-After, retry-after).
                raise RequestError(Status[code.name], f"prefill: {exc.details()}",
                                   retry_after_s=retry_after_from(exc.trailing_metadata())) from None
            log.warning("prefill at %s failed request %s: %s %s", address, upstream_id, code.name, exc.details())
            why = f"prefill service at {address} is unavailable ({code.name}: {exc.details()})"
            if connection_broke(exc):
                raise PrefillLost(why, reached) from None
            raise RequestError(Status.UNAVAILABLE, why) from None
        return reply

    async def await_serving(self, address: str, probe_id: str, deadline_s: float) -> bool:
        """Whether the prefill service at ``address`` answers a call within the wait (``wait_s``,
        within the deadline, loop time): a Cancel of ``probe_id`` (idempotent: the id of a call
        that broke, which the service may still hold) sent with wait_for_ready, so that a service
        that is restarting is waited for, and sent again when it breaks on a connection that had
        died without the channel knowing yet. A prompt sent again after a break goes out only on
        a connection that has just carried an answer: CI saw a resend spent at once on a channel
        that still said READY (the call ended "Stream removed" or "failed to connect" within
        milliseconds), and the prompt failed though its service was back a second later."""
        stub = prefill_pb2_grpc.PrefillStub(self._channels.get(address))
        loop = asyncio.get_running_loop()
        end_s = loop.time() + self._wait_bound_s(deadline_s)
        while (left_s := end_s - loop.time()) > 0:
            try:
                await stub.Cancel(prefill_pb2.CancelRequest(request_id=probe_id), timeout=left_s,
                                  wait_for_ready=True)
                return True
            except grpc.aio.AioRpcError as exc:
                if not connection_broke(exc):
                    return exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED  # it answered: it serves
            await asyncio.sleep(PROBE_PAUSE_S)
        return False

    # Cancellation -----------------------------------------------------------------------------

    def cancel_soon(self, upstream_id: str, prefill_address: str) -> None:
        """Cancel at the prefill service that had the request and at every decode service (the
        prefill service chose the decode side), in a task of its own, so that the cancellation
        of the caller (the client went away) cannot stop the cleanup that gives the request's
        KV blocks back. Both calls are idempotent."""
        calls: list[Awaitable[Any]] = [self._cancel_at(prefill_pb2_grpc.PrefillStub, prefill_address, upstream_id)]
        calls += [self._cancel_at(decode_pb2_grpc.DecodeStub, address, upstream_id)
                  for address in self.streams.addresses]

        async def cancel_all() -> None:
            await asyncio.gather(*calls)

        self._spawn(cancel_all())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _cancel_orphan(self, address: str, request_id: str) -> None:
        log.info("decode at %s streams request %s that nobody reads; cancelling it", address, request_id)
        self._spawn(self._cancel_at(decode_pb2_grpc.DecodeStub, address, request_id))

    async def _cancel_at(self, stub_type: Callable[[grpc.aio.Channel], Any], address: str, request_id: str) -> None:
        stub = stub_type(self._channels.get(address))
        try:
            await stub.Cancel(prefill_pb2.CancelRequest(request_id=request_id), timeout=self._cancel_timeout_s)
        except grpc.aio.AioRpcError as exc:
            # Best effort: a service that is down has lost the request's state anyway.
            log.debug("cancel of %s at %s failed: %s", request_id, address, exc.code().name)

    # Readiness --------------------------------------------------------------------------------

    async def readiness(self) -> Readiness:
        """Ready when a prefill service accepts a connection within HEALTH_PROBE_TIMEOUT_S and
        a decode service's token stream is open: a router started beside its services opens it
        only once decode serves, and a request decoded before that had no way to its client."""
        prefill, decode = self._prefill_addresses, self.streams.addresses
        prefill_ok = await self._any_reachable(prefill)
        decode_ok = bool(self.streams.open_addresses)
        problems: list[str] = []
        for role, addresses, ok, what in (("prefill", prefill, prefill_ok, "reachable"),
                                          ("decode", decode, decode_ok, "streaming to this router")):
            if not addresses:
                problems.append(f"no {role} service known")
            elif not ok:
                problems.append(f"no {role} service {what} ({', '.join(addresses)})")
        if problems:
            return Readiness(False, "; ".join(problems))
        return Readiness(True, f"prefill {', '.join(prefill)}; decode {', '.join(decode)}")

    async def _any_reachable(self, addresses: Sequence[str]) -> bool:
        if not addresses:
            return False

        async def probe(address: str) -> bool:
            try:
                async with asyncio.timeout(HEALTH_PROBE_TIMEOUT_S):
                    await self._channels.get(address).channel_ready()
            except TimeoutError:
                return False
            return True

        return any(await asyncio.gather(*(probe(a) for a in addresses)))
