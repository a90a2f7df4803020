"""gpu_agent's gRPC server: weights and KV pool in shared memory, the block ledger, the partition.

All allocator state lives in this one process and is touched only from its event loop, so
no lock is needed and a block can never be handed to two holders.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import grpc

from gpu_agent.blocks import BlockLedger
from gpu_agent.config import AgentConfig
from gpu_agent.leases import Leases
from gpu_agent.policy_loop import PolicyLoop
from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.config import ModelConfig
from tandem.engine.errors import InvalidRequestError, OutOfBlocksError
from tandem.engine.kv_pool import KVPool, KVPoolSpec, num_blocks_for_budget
from tandem.engine.model_cache import resolve_model
from tandem.engine.quant import WeightFormat, effective_format
from tandem.engine.shm import SharedTensorStore
from tandem.engine.weights import load_checkpoint, parse_dtype, share_weights
from tandem.rpc.v1 import agent_pb2, agent_pb2_grpc, common_pb2

log = logging.getLogger("tandem.gpu_agent")


class PartitionBoard:
    """The partition in force and a way to wait for the next one."""

    def __init__(self, initial: common_pb2.Partition) -> None:
        self.current = initial
        self._changed = asyncio.Condition()

    async def set(self, prefill_units: list[int], decode_units: list[int], policy: str, lookahead: int = 1, *,
                  aggregated: bool = False, prefill_token_budget: int = 0, prefill_layers: int = 0,
                  preempt: str = "", prefill_first: tuple[str, ...] = ()) -> None:
        async with self._changed:
            self.current = common_pb2.Partition(
                epoch=self.current.epoch + 1, prefill_units=prefill_units, decode_units=decode_units,
                decode_lookahead=lookahead, policy=policy, aggregated=aggregated,
                prefill_token_budget=prefill_token_budget, prefill_layers=prefill_layers,
                preempt=preempt, prefill_first=prefill_first,
            )
            self._changed.notify_all()

    async def wait_newer(self, epoch: int) -> common_pb2.Partition:
        async with self._changed:
            await self._changed.wait_for(lambda: self.current.epoch > epoch)
            return self.current


class GpuAgentServicer(agent_pb2_grpc.GpuAgentServicer):
    def __init__(self, config: AgentConfig, model_dir: Path, weights_name: str, pool: KVPool,
                 ledger: BlockLedger, partition: PartitionBoard, policy: PolicyLoop | None = None) -> None:
        self.config = config
        self.policy = policy
        self.model_dir = model_dir
        self.weights_name = weights_name
        self.pool = pool
        self.ledger = ledger
        self.partition = partition
        self.services: dict[str, agent_pb2.RegisterRequest] = {}
        self.leases = Leases(ledger, lambda sid: sid in self.services and
                             self.services[sid].role == agent_pb2.ROLE_DECODE)
        # Resolved once ("auto" -> a concrete format), so every service of the cell runs the same.
        self.weight_format = effective_format(WeightFormat.parse(config.quantization), parse_dtype(config.dtype))

    async def Register(self, request: agent_pb2.RegisterRequest, context: grpc.aio.ServicerContext) -> agent_pb2.RegisterReply:  # noqa: N802
        self.services[request.service_id] = request
        log.info("registered %s %s at %s", agent_pb2.Role.Name(request.role), request.service_id, request.address)
        spec = self.pool.spec
        assert self.pool.store is not None
        return agent_pb2.RegisterReply(
            cell_id=self.config.cell_id,
            model_dir=str(self.model_dir),
            weights_shm_name=self.weights_name,
            kv_pool=agent_pb2.KVPoolInfo(
                shm_name=self.pool.store.name, num_layers=spec.num_layers, num_blocks=spec.num_blocks,
                block_size=spec.block_size, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                dtype=self.config.kv_pool_dtype,
            ),
            partition=self.partition.current,
            dtype=self.config.dtype,
            weight_format=self.weight_format.value,
        )

    async def Allocate(self, request: agent_pb2.AllocateRequest, context: grpc.aio.ServicerContext) -> agent_pb2.AllocateReply:  # noqa: N802
        start = time.perf_counter_ns()
        try:
            alloc = self.ledger.allocate(request.request_id, list(request.token_ids), request.num_extra_tokens,
                                         owner=request.owner)
        except OutOfBlocksError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"KV pool full: {exc}")
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return agent_pb2.AllocateReply(
            block_ids=alloc.block_ids, num_cached_tokens=alloc.num_cached_tokens,
            server_ns=time.perf_counter_ns() - start,
        )

    async def Extend(self, request: agent_pb2.ExtendRequest, context: grpc.aio.ServicerContext) -> agent_pb2.ExtendReply:  # noqa: N802
        start = time.perf_counter_ns()
        try:
            new = self.ledger.extend(request.request_id, request.num_tokens, request.owner or None)
        except OutOfBlocksError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"KV pool full: {exc}")
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        return agent_pb2.ExtendReply(new_block_ids=new, block_ids=self.ledger.blocks_of(request.request_id) or [],
                                     server_ns=time.perf_counter_ns() - start)

    async def Publish(self, request: agent_pb2.PublishRequest, context: grpc.aio.ServicerContext) -> agent_pb2.PublishReply:  # noqa: N802
        try:
            num = self.ledger.publish(request.request_id, list(request.token_ids), request.owner or None)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        return agent_pb2.PublishReply(num_published=num)

    async def Release(self, request: agent_pb2.ReleaseRequest, context: grpc.aio.ServicerContext) -> agent_pb2.ReleaseReply:  # noqa: N802
        return agent_pb2.ReleaseReply(num_released=self.ledger.release(request.request_id, list(request.token_ids),
                                                                       request.owner or None))

    async def Claim(self, request: agent_pb2.ClaimRequest, context: grpc.aio.ServicerContext) -> agent_pb2.ClaimReply:  # noqa: N802
        try:
            missing, blocks = self.ledger.claim(request.owner, list(request.request_ids))
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return agent_pb2.ClaimReply(missing=missing, blocks=[
            agent_pb2.BlockList(request_id=rid, block_ids=ids) for rid, ids in blocks.items()])

    async def WatchPartition(self, request: agent_pb2.WatchPartitionRequest, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]  # noqa: N802
        # The stream is the service's lease (see gpu_agent/leases.py).
        self.leases.opened(request.service_id)
        try:
            current = self.partition.current
            yield current
            while True:
                current = await self.partition.wait_newer(current.epoch)
                yield current
        finally:
            self.leases.closed(request.service_id)

    async def ReportLoad(self, request: agent_pb2.PhaseLoad, context: grpc.aio.ServicerContext) -> agent_pb2.ReportLoadReply:  # noqa: N802
        if self.policy is not None:
            self.policy.report(request)
            await _apply_policy(self.policy, self.partition)
        return agent_pb2.ReportLoadReply(partition=self.partition.current)

    async def GetStats(self, request: agent_pb2.GetStatsRequest, context: grpc.aio.ServicerContext) -> agent_pb2.AgentStats:  # noqa: N802
        alloc = self.ledger.allocator
        return agent_pb2.AgentStats(
            num_blocks=alloc.num_blocks, num_free_blocks=alloc.num_free_blocks, num_requests=self.ledger.num_requests,
            num_prefix_query_tokens=alloc.num_prefix_queries_tokens, num_prefix_hit_tokens=alloc.num_prefix_hit_tokens,
            partition=self.partition.current, num_reclaimed_requests=self.leases.num_reclaimed_requests,
            num_reclaimed_blocks=self.leases.num_reclaimed_blocks,
        )


async def _apply_policy(policy: PolicyLoop | None, partition: PartitionBoard) -> None:
    if policy is None:
        return
    change = policy.decide()
    if change is not None:
        applied, reason = change
        await partition.set(applied.prefill_cores, applied.decode_cores, reason, applied.decode_lookahead,
                            aggregated=applied.aggregated, prefill_token_budget=applied.prefill_token_budget,
                            prefill_layers=applied.prefill_layers, preempt=applied.preempt,
                            prefill_first=applied.prefill_first)


async def policy_ticks(policy: PolicyLoop | None, partition: PartitionBoard, interval_s: float = 0.1) -> None:
    """Re-decide periodically too: deadlines move with time even when no report arrives."""
    while policy is not None:
        await asyncio.sleep(interval_s)
        await _apply_policy(policy, partition)


def build_state(config: AgentConfig) -> tuple[Path, SharedTensorStore, KVPool, BlockLedger]:
    """Load the weights into shared memory and create the shared KV pool (the slow part)."""
    model_dir = resolve_model(config.model)
    model_config = ModelConfig.from_dir(model_dir)
    dtype, kv_dtype = parse_dtype(config.dtype), parse_dtype(config.kv_pool_dtype)
    weights = load_checkpoint(model_dir, model_config, dtype)
    store = share_weights(weights, f"{config.shm_prefix}-weights", exist_ok=True)
    del weights
    num_blocks = config.num_blocks or num_blocks_for_budget(
        model_config, int(config.kv_cache_gb * (1 << 30)), config.block_size, kv_dtype
    )
    spec = KVPoolSpec.for_model(model_config, num_blocks, config.block_size, kv_dtype)
    pool = KVPool.create_shared(spec, f"{config.shm_prefix}-kv", exist_ok=True)
    return model_dir, store, pool, BlockLedger(BlockAllocator(num_blocks, config.block_size))
