"""The router process: builds the core, its two adapters and discovery, and runs them.

    RouterConfig ─▶ Tokenizer, AdmissionController, Upstream ─▶ RouterCore
                    RouterCore ◀── RouterServicer (gRPC, router.grpc_api)
                    RouterCore ◀── Gateway (OpenAI HTTP, router.http), when --http-port is set
    UpstreamSource (flags or Redis registry) ─▶ Upstream.set_upstreams, every discovery interval
    AgentLoad (Redis load board) ─▶ admission and the /metrics cell gauges, every 250 ms
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio

from router.config import RouterConfig
from router.core import RouterCore
from router.grpc_api import RouterServicer
from router.metrics import RouterMetrics
from tandem.rpc.channels import ChannelPool, bind, new_server
from router.models import ServedModels
from router.upstream import RegistryUpstreams, StaticUpstreams, Upstream, UpstreamSource
from router.wire_errors import MalformedRequestInterceptor
from tandem.engine.config import ModelConfig
from tandem.engine.tokenizer import Tokenizer
from tandem.protocol import LoadReport
from tandem.rpc.tracing import (
    service_client_interceptors,
    service_server_interceptors,
    setup_tracing,
    shutdown_tracing,
)
from tandem.rpc.v1 import router_pb2_grpc
from tandem.service.registry import announce, await_redis, redis_client
from tandem.service.runtime import serving

if TYPE_CHECKING:
    from router.admission import AdmissionController
    from router.http import HttpServer

log = logging.getLogger("tandem.router")

DISCOVERY_WAITING_S = 0.2  # how often the registry is re-read while a model lacks a service
GRPC_CUT_AFTER_END_S = 1.0  # grpc cancels calls this long after InFlight.end_all asked them to end


class AgentLoad:
    """The agent's entry on the Redis load board (the partition in force, the KV pool)."""

    def __init__(self, redis_url: str, cell_id: str) -> None:
        from tandem.state.load_board import LoadBoard

        self._client = redis_client(redis_url)
        self._board = LoadBoard(self._client)
        self._cell_id = cell_id or None

    async def read(self) -> LoadReport | None:
        return next((r for r in await self.read_cell() if r.role == "agent"), None)

    async def read_cell(self) -> list[LoadReport]:
        """Every live service's entry of the cell (the agent's, prefill's, decode's)."""
        return await self._board.read(self._cell_id)

    async def close(self) -> None:
        await self._client.aclose()


class RunningRouter:
    """A started router: a core per served model (``models``; ``core`` is the first's), its gRPC
    server at ``address``, the HTTP gateway (``http``, None unless ``config.http_port`` is set) and
    the background tasks (discovery, following the agent's load). ``stop`` undoes
    ``start_router`` in reverse."""

    def __init__(self, config: RouterConfig, models: ServedModels, metrics: RouterMetrics, server: grpc.aio.Server,
                 channels: ChannelPool, address: str, sources: list[UpstreamSource],
                 close_source: Callable[[], Awaitable[None]] | None, agent_load: AgentLoad | None) -> None:
        self.config = config
        self.models = models
        self.core = models.primary
        self.metrics = metrics
        self.server = server
        self.address = address
        self.agent_load = agent_load
        self.http: HttpServer | None = None
        self._channels = channels
        self._sources = sources  # one per model, in the models' order
        self._close_source = close_source
        self._tasks: list[asyncio.Task[None]] = []

    async def refresh_upstreams(self) -> None:
        """Ask the sources once and apply what they say; errors keep the previous upstreams."""
        for core, source in zip(self.models, self._sources, strict=True):
            try:
                upstreams = await source.fetch()
            except Exception as exc:  # Redis down: keep routing to what we knew
                log.warning("upstream discovery failed, keeping the previous upstreams: %s", exc)
                return
            core.upstream.set_upstreams(upstreams)

    async def start(self) -> None:
        """Learn the upstreams, start the background tasks, then serve HTTP and gRPC."""
        loop = asyncio.get_running_loop()
        await self.refresh_upstreams()
        if not all(isinstance(source, StaticUpstreams) for source in self._sources):
            self._tasks.append(loop.create_task(self._discover(), name="router-discovery"))
        for core in self.models:
            if self.agent_load is not None and core.admission is not None:
                self._tasks.append(loop.create_task(core.admission.follow(self.agent_load.read),
                                                    name=f"router-agent-load-{core.model_id}"))
        if self.config.http_port is not None:
            # HTTP listens before gRPC does: whoever waits for the gRPC port (tandem up's readiness
            # check) may then use both at once.
            from router.http import Gateway, start_http

            read_cell = self.agent_load.read_cell if self.agent_load is not None else None
            gateway = Gateway(self.models, self.metrics, self.config.api_key, read_cell,
                              self.config.allowed_origins)
            self.http = await start_http(gateway, self.config.host, self.config.http_port)
        await self.server.start()

    async def _discover(self) -> None:
        """Re-read the sources every ``discovery_interval_s`` (registry sources only), and every
        ``DISCOVERY_WAITING_S`` while a model has no prefill or no decode service known: a
        router starts beside its services (``tandem up``), which announce themselves once they
        serve, and it should route to them at once."""
        while True:
            missing = not all(core.upstream.knows_both for core in self.models)
            await asyncio.sleep(DISCOVERY_WAITING_S if missing else self.config.discovery_interval_s)
            await self.refresh_upstreams()

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stop taking requests on both APIs; those in flight get ``grace_s`` to finish, then end
        with UNAVAILABLE and a message (``InFlight.end_all``) rather than the servers' bare cut.
        Then cancel upstream work and close."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        loop = asyncio.get_running_loop()
        stopping = {loop.create_task(self.server.stop(grace_s + GRPC_CUT_AFTER_END_S))}
        if self.http is not None:
            stopping.add(loop.create_task(self.http.stop()))
        _, unfinished = await asyncio.wait(stopping, timeout=grace_s)
        if unfinished:
            ended = self.models.in_flight.end_all("the router is shutting down; send the request again")
            log.info("router stopping: %d requests still in flight after %.1f s end with UNAVAILABLE", ended, grace_s)
        await asyncio.gather(*stopping, return_exceptions=True)
        for core in self.models:  # following the agent's load saved it already, where it ran
            if core.admission is not None:
                core.admission.save_calibration()
                core.admission.close_log()
        if self.agent_load is not None:
            await self.agent_load.close()
        await self.models.close()
        await self._channels.close()
        if self._close_source is not None:
            await self._close_source()


async def start_router(config: RouterConfig, source: UpstreamSource | None = None) -> RunningRouter:
    """Load the tokenizers, bind the port, learn the upstreams and start serving.

    ``source`` (of the first model's upstreams) defaults to the flags' addresses, or the Redis
    registry when none were given; the other models' always come from the registry. Raises
    ModelLoadError for an unusable model directory, OSError for a port in use.
    """
    metrics = RouterMetrics()
    channels = ChannelPool(service_client_interceptors())
    cores = []
    for index, (name, model_dir) in enumerate(config.served_models):
        tokenizer, model_config = await asyncio.to_thread(_load_tokenizer, model_dir)
        admission = await asyncio.to_thread(_admission_controller, config, model_config,
                                            name if config.extra_models else "", name)
        sampling_defaults = await asyncio.to_thread(config.sampling_defaults, model_dir)
        if sampling_defaults.changed():
            log.info("sampling defaults of %s for what requests leave out: %s", name, sampling_defaults.changed())
        upstream = Upstream(config.router_id, channels, config.cancel_timeout_s, config.stall_timeout_s,
                            config.upstream_wait_s)
        cores.append(RouterCore(config, tokenizer, model_config, upstream, metrics.for_model(name), admission,
                                sampling_defaults, model_id=name, primary=index == 0))
    models = ServedModels(cores)
    interceptors: list[Any] = list(service_server_interceptors())
    if config.api_key:
        from router.auth import ApiKeyInterceptor

        interceptors.append(ApiKeyInterceptor(config.api_key))
    # Innermost: the API key is checked first, whatever bytes came with the call.
    interceptors.append(MalformedRequestInterceptor())
    server = new_server(interceptors)
    router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(models), server)
    port = bind(server, f"{config.host}:{config.grpc_port}")
    close_source: Callable[[], Awaitable[None]] | None = None
    sources: list[UpstreamSource] = []
    if source is None and config.static_upstreams:
        source = StaticUpstreams(config.prefill_addresses, config.decode_addresses)
    if source is None or config.extra_models:
        registry_sources, close_source = _registry_sources(config)
        sources = [source or registry_sources[0], *registry_sources[1:]]
    else:
        sources = [source]
    agent_load = AgentLoad(config.redis_url, config.cell_id) if config.redis_url else None
    running = RunningRouter(config, models, metrics, server, channels, f"{config.host}:{port}", sources,
                            close_source, agent_load)
    try:
        await running.start()
    except BaseException:
        await running.stop()
        raise
    return running


def _registry_sources(config: RouterConfig) -> tuple[list[UpstreamSource], Callable[[], Awaitable[None]]]:
    """A registry-backed source per served model (of every model's services when the router
    serves one) and the function that closes their Redis client."""
    from tandem.state.registry import Registry

    client = redis_client(config.redis_url)
    registry = Registry(client)
    if not config.extra_models:
        return [RegistryUpstreams(registry, config.cell_id)], client.aclose
    return [RegistryUpstreams(registry, config.cell_id, model=name) for name, _ in config.served_models], client.aclose


def _load_tokenizer(model_dir: Path) -> tuple[Tokenizer, ModelConfig]:
    tokenizer = Tokenizer.from_dir(model_dir)
    log.info("prompt size bound of %s: %s bytes per token", model_dir.name,
             tokenizer.max_bytes_per_token or "none (this tokenizer can drop text)")  # computed once, here
    return tokenizer, ModelConfig.from_dir(model_dir)


def _admission_controller(config: RouterConfig, model_config: ModelConfig, model: str,
                          served_name: str) -> AdmissionController:
    """``model``: the name whose KV figures admission reads from the agent's report ("" in a
    router of one model); ``served_name`` names its calibration file."""
    from router.admission import AdmissionController
    from router.calibration_cache import CalibrationCache
    from tandem.engine.model_cache import cache_file_stem
    from tandem.perf.predictor import cpu_predictor
    from tandem.policy.admission import PrefillBatching
    from tandem.policy.types import Slo

    num_units = len(os.sched_getaffinity(0))
    predictor = cpu_predictor(model_config, num_units, config.profile or None)
    slo = Slo(config.ttft_slo_ms / 1000, config.tbt_slo_ms / 1000, config.ttft_slo_ms_per_1k / 1000)
    batching = PrefillBatching(config.max_batch_tokens, config.max_batch_requests)
    cache = None
    if config.admission_cache:
        cache = CalibrationCache(Path(config.admission_cache) / f"{cache_file_stem(served_name)}.json")
    decision_log = None
    if config.admission_log:
        path = Path(config.admission_log)
        if model:  # a router of several models: one file each
            path = path.with_name(f"{path.stem}.{cache_file_stem(served_name)}{path.suffix}")
        decision_log = open(path, "a", buffering=1)  # noqa: SIM115 (closed with the router)
    return AdmissionController(predictor, slo, enabled=config.admission, default_units=num_units, batching=batching,
                               margin=config.admission_margin, stream_cap=config.stream_cap, model=model,
                               cache=cache, miss_target=config.admission_miss_target, decision_log=decision_log)


async def serve(config: RouterConfig, stop_event: asyncio.Event) -> None:
    """Run the router until ``stop_event`` is set; with a Redis URL it is registered (role
    ``router``) while it serves."""
    setup_tracing("router")
    started_s = time.perf_counter()
    await await_redis(config.redis_url, stop_event)
    running = await start_router(config)
    try:
        async with announce(config.redis_url, "router", config.cell_id, running.address,
                            service_id=config.router_id):
            http = f"HTTP at http://{running.http.address}; " if running.http is not None else ""
            serving()
            log.info("router %s ready at %s (pid %d): %smodel %s, context %d, upstreams from %s, started in %.1fs",
                     config.router_id, running.address, os.getpid(), http, ", ".join(running.models.names),
                     running.core.context_length, "flags" if config.static_upstreams else "registry",
                     time.perf_counter() - started_s)
            await stop_event.wait()
    finally:
        await running.stop()
        shutdown_tracing()
        log.info("router %s stopped", config.router_id)
