"""Joining a cell: register with its gpu_agent, map the shared weights and KV pool, follow the
partition. prefill_svc and decode_svc both start this way.

Torch work of a member runs on one dedicated thread (``run``), so the partition — CPU cores
and the intra-op thread count — is applied in the thread that does the work, and only at the
boundaries the caller chooses (between layer groups, between decode steps).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import grpc
import torch

from tandem.cuda import DEFAULT_EAGER_ATTENTION
from tandem.engine.config import ModelConfig
from tandem.engine.kv_pool import KVPool, KVPoolSpec
from tandem.engine.quant import WeightFormat
from tandem.engine.runner import PROMPT_TIMING_SIZES, ModelRunner, PromptStepTiming, build_model, warm_up
from tandem.engine.shm import SharedTensorStore
from tandem.engine.weights import attach_weights, parse_dtype
from tandem.rpc.channels import MESH_RECONNECT_OPTIONS
from tandem.rpc.tracing import service_client_interceptors
from tandem.rpc.v1 import agent_pb2, agent_pb2_grpc, common_pb2
from tandem.service.core_locks import CoreLocks

if TYPE_CHECKING:
    from tandem.cuda.partition import PhaseStream, SmPartitions

log = logging.getLogger("tandem.cell")
T = TypeVar("T")
RPC_TIMEOUT_S = 10.0
# How long a service's request waits through its agent's outage (its Allocate or Extend finding the
# agent unreachable, asked again meanwhile) before it fails: an agent that dies takes its cell down
# (`tandem up` restarts the cell whole; under compose the services exit when its files go), and a
# request still waiting then is stopped with its service, whose successor (decode) or the router
# (a prompt) carries it on; failed at once, its client had the error.
AGENT_WAIT_S = 10.0
# How long a joining service waits for its agent: ``tandem up`` starts them together, and the
# agent serves only once it has loaded the weights (as long as ``tandem up --ready-timeout-s``).
JOIN_WAIT_S = 300.0
GPU_SERVICE_THREADS = 4  # torch's host threads in a service of a CUDA cell


def apply_cpu_partition(cores: list[int]) -> None:
    """Pin every thread of this process to ``cores`` and size torch's pool to match.

    ``sched_setaffinity`` acts on one thread; the intra-op (OpenMP) workers already exist,
    so each task of the process is pinned, then the calling thread sets the thread count.
    """
    allowed = set(cores)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), allowed)
        except (ProcessLookupError, PermissionError, OSError):
            pass  # a thread that just exited, or a core the container does not have
    torch.set_num_threads(max(1, len(cores)))


class CellMember:
    def __init__(self, role: agent_pb2.Role, service_id: str, address: str, agent_address: str,
                 weight_format: WeightFormat | None = None, model: str = "",
                 eager_attention: str = DEFAULT_EAGER_ATTENTION):
        self.role = role
        self.eager_attention = eager_attention  # --cuda-eager-attention (a CPU cell runs torch's)
        self.model = model  # the served name of the cell's model it computes ("": the cell's first)
        self.service_id = service_id
        self.address = address
        self.agent_address = agent_address
        self.weight_format = weight_format  # None: the one the agent names for the cell
        self.computes = True  # False: a prefill service of a cell that never splits (set at join)
        # A service starts beside its agent (``tandem up`` starts a cell's processes at once), and
        # a restarted agent listens again on the same address: either way the service should see
        # it within a quarter of a second, not after gRPC's default reconnect backoff.
        self.channel = grpc.aio.insecure_channel(agent_address, interceptors=service_client_interceptors(),
                                                 options=MESH_RECONNECT_OPTIONS)
        self.agent = agent_pb2_grpc.GpuAgentStub(self.channel)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"torch-{service_id}")
        self.partition = common_pb2.Partition()
        self._applied_epoch = -1
        self._stores: list[SharedTensorStore] = []
        self.cell_id = ""
        self.model_dir = Path()
        self.runner: ModelRunner | None = None
        self._watch: asyncio.Task[None] | None = None
        self._report: asyncio.Task[None] | None = None
        self._pending_load: agent_pb2.PhaseLoad | None = None
        self._sm_partitions: SmPartitions | None = None  # a CUDA cell: the green-context splits
        self._phase_stream: PhaseStream | None = None
        self.scratch_block: int | None = None  # a CUDA cell: the pool block graph padding writes to
        self._core_locks: CoreLocks | None = None  # a CPU cell: held on the pinned cores while computing
        self._pinned: list[int] = []  # the cores this member's threads run on (a CPU cell)
        self.on_partition: list[Callable[[], None]] = []  # called (in the event loop) on each newer partition
        self.prompt_timings: list[PromptStepTiming] = []  # decode: timed at attach (warm_up)

    @property
    def phase(self) -> str:
        """The phase this member computes: "prefill" or "decode"."""
        return "prefill" if self.role == agent_pb2.ROLE_PREFILL else "decode"

    @property
    def units(self) -> list[int]:
        p = self.partition
        return list(p.prefill_units if self.role == agent_pb2.ROLE_PREFILL else p.decode_units)

    async def join(self, wait_s: float = JOIN_WAIT_S) -> ModelRunner:
        """Register (retrying while the agent starts: it may be loading the weights), attach
        shared state, build the runner."""
        request = agent_pb2.RegisterRequest(service_id=self.service_id, role=self.role, address=self.address,
                                            model=self.model)
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            try:
                reply = await self.agent.Register(request, timeout=RPC_TIMEOUT_S, wait_for_ready=True)
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:  # the cell does not serve that model
                    raise RuntimeError(f"gpu_agent at {self.agent_address}: {exc.details()}") from exc
                if asyncio.get_running_loop().time() > deadline:
                    raise RuntimeError(f"gpu_agent at {self.agent_address} unreachable: {exc.details()}") from exc
                await asyncio.sleep(0.2)
        self.cell_id = reply.cell_id
        self.model = reply.model or self.model
        self.model_dir = Path(reply.model_dir)
        self.partition = reply.partition
        self.scratch_block = reply.scratch_block if reply.HasField("scratch_block") else None
        self.runner = await self.run(lambda: self._attach(reply))
        await self.run(self.apply_partition)  # joining is the first boundary
        self._watch = asyncio.create_task(self._follow_partition(), name="watch-partition")
        return self.runner

    def _attach(self, reply: agent_pb2.RegisterReply) -> ModelRunner:
        config = ModelConfig.from_dir(self.model_dir)
        info = reply.kv_pool
        spec = KVPoolSpec(info.num_layers, info.num_blocks, info.block_size, info.num_kv_heads, info.head_dim,
                          parse_dtype(info.dtype), info.layout or "layer")
        if reply.cuda_kv:
            # A CUDA cell: the agent's GPU memory, mapped through its IPC handles (no copy).
            from tandem.cuda.ipc import open_tensors

            weights = open_tensors(reply.cuda_weights)
            pool = KVPool(spec, open_tensors(reply.cuda_kv)["kv"])
            log.info("%s mapped the agent's weights and KV pool on %s by CUDA IPC handle", self.service_id,
                     pool.tensor.device)
        else:
            store, weights = attach_weights(reply.weights_shm_name)
            pool = KVPool.attach(spec, info.shm_name, info.offset_bytes)
            self._stores = [store] + ([pool.store] if pool.store is not None else [])
            self._core_locks = CoreLocks()
        fmt = self.weight_format or WeightFormat.parse(reply.weight_format or "fp32")
        # A prefill service of a cell that never splits forwards every prompt to decode: it
        # reads the shared weights as they are (no private copy, no warm-up) should it ever run one.
        self.computes = not (reply.aggregated_only and self.role == agent_pb2.ROLE_PREFILL)
        if not self.computes:
            fmt = WeightFormat.FP32
        attention = "torch"
        if pool.tensor.device.type == "cuda":
            from tandem.cuda.graphs import resolve_graph_attention

            attention, why = resolve_graph_attention(self.eager_attention, pool, weights["embed_tokens"].dtype,
                                                     "--cuda-eager-attention")
            log.info("%s: steps run op by op attend with %s (--cuda-eager-attention %s: %s)", self.service_id,
                     attention, self.eager_attention, why)
        model = build_model(self.model_dir, config, weights, attention, fmt)
        if self.computes:
            # before the service says it is ready, not on its first request; decode also times
            # what the agent fits a hybrid step's prompt part on (reported with every load)
            timed = self.role == agent_pb2.ROLE_DECODE and not reply.skip_prompt_timings
            self.prompt_timings = warm_up(model, time_prompts=PROMPT_TIMING_SIZES if timed else ())
        runner = ModelRunner(model, pool)
        if pool.tensor.device.type == "cuda":
            runner.host_logits = True  # the services sample on the host
            # The host's share of a GPU step is small (sampling, plans): a few threads. torch's
            # default (every core) in each of the cell's processes oversubscribes the host, and
            # OpenMP's spinning workers then stall each other.
            torch.set_num_threads(GPU_SERVICE_THREADS)
            from tandem.cuda.partition import SERVICE_MIN_SMS, SERVICE_SPLIT_STEP, SmPartitions

            self._sm_partitions = SmPartitions(pool.tensor.device.index or 0, min_sms=SERVICE_MIN_SMS,
                                               step=SERVICE_SPLIT_STEP)
        return runner

    async def _follow_partition(self) -> None:
        while True:
            try:
                async for partition in self.agent.WatchPartition(
                    agent_pb2.WatchPartitionRequest(service_id=self.service_id)
                ):
                    self._take(partition)
            except grpc.aio.AioRpcError as exc:
                log.warning("partition stream lost (%s); retrying", exc.code().name)
                await asyncio.sleep(0.5)

    def report_load(self, load: agent_pb2.PhaseLoad) -> None:
        """Send ``load`` to the agent's scheduler without waiting; while one report is in flight
        only the newest later one is kept (older ones are stale)."""
        self._pending_load = load
        if self._report is None or self._report.done():
            self._report = asyncio.create_task(self._send_reports(), name="report-load")

    async def _send_reports(self) -> None:
        while self._pending_load is not None:
            load, self._pending_load = self._pending_load, None
            try:
                reply = await self.agent.ReportLoad(load, timeout=RPC_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                log.warning("load report to the agent failed: %s", exc.code().name)
                continue
            self._take(reply.partition)  # sooner than the watch stream delivers it

    def _take(self, partition: common_pb2.Partition) -> None:
        """Keep ``partition`` if it is newer than the one held, and say so to ``on_partition``."""
        if partition.epoch <= self.partition.epoch:
            return
        self.partition = partition
        for callback in self.on_partition:
            callback()

    async def release(self, request_id: str, token_ids: Sequence[int] = ()) -> None:
        """Give a request's blocks back to the agent (publishing ``token_ids``' K/V first), as
        their owner: a request another service has taken over is left alone. A failed call is
        logged; the agent reclaims what this service holds when its lease ends. So is a call after
        ``close`` (a shutdown that closed the channel while a request still ended): before, its
        ``UsageError`` escaped, a task's exception that nobody retrieved."""
        try:
            await self.agent.Release(
                agent_pb2.ReleaseRequest(request_id=request_id, token_ids=token_ids, owner=self.service_id),
                timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.error("could not release blocks of %s: %s", request_id, exc.details())
        except grpc.aio.UsageError as exc:
            log.warning("could not release blocks of %s: %s (shutting down; the agent reclaims them when this "
                        "service's lease ends)", request_id, exc)

    def apply_partition(self) -> bool:
        """Apply a newer partition; call only from the torch thread, at a boundary."""
        if self.partition.epoch == self._applied_epoch or not self.units:
            return False
        self._applied_epoch = self.partition.epoch
        if self._sm_partitions is not None:
            self._apply_sm_partition(len(self.units))
            assert self._phase_stream is not None
            log.info("%s applied partition epoch %d: %d of %d SMs", self.service_id, self.partition.epoch,
                     self._phase_stream.partition.sms(self._phase_stream.phase), self._sm_partitions.total_sms)
            return True
        if self.units == self._pinned:
            # A newer decision on the same cores (a budget for more streams, another reason):
            # nothing to re-pin, and no log line (with prompts waiting, one came every few steps).
            return False
        apply_cpu_partition(self.units)
        self._pinned = self.units
        log.info("%s applied partition epoch %d: cores %s", self.service_id, self.partition.epoch, self.units)
        return True

    def _apply_sm_partition(self, sms: int) -> None:
        """A CUDA cell: the partition's unit count is this phase's SM count. The torch thread's
        current stream becomes this phase's side of the nearest green-context split (the whole
        device when the phase has every unit), so everything launched from here on runs there
        and stays ordered after what was launched before (``PhaseStream.switch``)."""
        from tandem.cuda.partition import PhaseStream

        parts = self._sm_partitions
        assert parts is not None
        part = parts.for_phase(self.phase, sms)
        if self._phase_stream is None:
            self._phase_stream = PhaseStream(self.phase, part)
            torch.cuda.set_stream(self._phase_stream.stream)
        else:
            torch.cuda.set_stream(self._phase_stream.switch(part))

    def phase_streams(self) -> list[torch.cuda.Stream]:
        """A CUDA cell: every stream this member's phase may be switched to (its side of each
        split, the whole device's included), the current one first; [] on a CPU cell."""
        if self._sm_partitions is None:
            return []
        current = torch.cuda.current_stream()
        streams = {current.cuda_stream: current}
        for part in self._sm_partitions.partitions.values():
            if part.sms(self.phase) > 0:
                stream = part.stream(self.phase)
                streams.setdefault(stream.cuda_stream, stream)
        return list(streams.values())

    async def run(self, fn: Callable[[], T]) -> T:
        """Run torch work on the member's torch thread. Each call is a boundary: in a CPU cell a
        newer partition is applied first, and the work holds the locks of the cores it runs on
        (``tandem.service.core_locks``), so members sharing a core take turns."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, self._on_cores, fn)

    def _on_cores(self, fn: Callable[[], T]) -> T:
        if self._core_locks is None:
            return fn()
        self.apply_partition()
        if not self._pinned:  # joining: not pinned yet
            return fn()
        with self._core_locks.hold(self._pinned):
            return fn()

    def core_lock_holders(self) -> list[str]:
        """Who holds and who waits for the locks of the cores this member is pinned to (a CPU
        cell; [] otherwise)."""
        return self._core_locks.holders(self._pinned) if self._core_locks is not None else []

    async def close(self) -> None:
        for task in (self._watch, self._report):
            if task is not None:
                task.cancel()
        await self.channel.close()
        # the core locks' files stay open until the process exits: a step may still hold them
        self.executor.shutdown(wait=False, cancel_futures=True)
