"""gpu_agent's gRPC server: weights and KV pool in shared memory, the block ledger, the partition.

All allocator state lives in this one process and is touched only from its event loop, so
no lock is needed and a block can never be handed to two holders.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from gpu_agent.blocks import BlockLedger
from gpu_agent.config import AgentConfig
from gpu_agent.leases import Leases
from gpu_agent.models import Cell, build_cell, build_cuda_cell
from gpu_agent.policy_loop import PolicyLoop
from tandem.engine.errors import InvalidRequestError, OutOfBlocksError
from tandem.engine.kv_slab import SlabBlockAllocator
from tandem.rpc.convert import kv_freed_metadata
from tandem.rpc.v1 import agent_pb2, agent_pb2_grpc, common_pb2

log = logging.getLogger("tandem.gpu_agent")


class PartitionBoard:
    """The partition in force and a way to wait for the next one."""

    def __init__(self, initial: common_pb2.Partition) -> None:
        self.current = initial
        self._changed = asyncio.Condition()

    async def set(self, prefill_units: list[int], decode_units: list[int], policy: str, lookahead: int = 1, *,
                  aggregated: bool = False, prefill_token_budget: int = 0, prefill_layers: int = 0,
                  preempt: str = "", prefill_first: tuple[str, ...] = (), prefill_held: bool = False,
                  model_token_budgets: dict[str, int] | None = None, streams_decoding: bool = False,
                  decode_streams: int = 0, spent_gap_us: int = 0) -> None:
        async with self._changed:
            self.current = common_pb2.Partition(
                epoch=self.current.epoch + 1, prefill_units=prefill_units, decode_units=decode_units,
                decode_lookahead=lookahead, policy=policy, aggregated=aggregated,
                prefill_token_budget=prefill_token_budget, prefill_layers=prefill_layers,
                preempt=preempt, prefill_first=prefill_first, prefill_held=prefill_held,
                model_token_budgets=model_token_budgets or {}, streams_decoding=streams_decoding,
                decode_streams=decode_streams, spent_gap_us=spent_gap_us,
            )
            self._changed.notify_all()

    async def wait_newer(self, epoch: int) -> common_pb2.Partition:
        async with self._changed:
            await self._changed.wait_for(lambda: self.current.epoch > epoch)
            return self.current


class GpuAgentServicer(agent_pb2_grpc.GpuAgentServicer):
    """The cell's RPCs. A service registers for one of the cell's models (``Register.model``); its
    allocations and claims go to that model's ledger, and calls naming a request to the ledger
    that holds it (request ids are unique across the cell)."""

    def __init__(self, config: AgentConfig, cell: Cell, partition: PartitionBoard,
                 policy: PolicyLoop | None = None) -> None:
        self.config = config
        self.policy = policy
        self.cell = cell
        self.ledgers = cell.ledgers()
        self.partition = partition
        self.services: dict[str, agent_pb2.RegisterRequest] = {}
        self.leases = Leases(self.ledgers, lambda sid: sid in self.services and
                             self.services[sid].role == agent_pb2.ROLE_DECODE)

    def _ledger_of(self, owner: str) -> BlockLedger:
        """The ledger of the model ``owner`` computes (the first model's for an unregistered caller)."""
        registered = self.services.get(owner)
        return self.cell.model(registered.model if registered is not None else "").ledger

    async def Register(self, request: agent_pb2.RegisterRequest, context: grpc.aio.ServicerContext) -> agent_pb2.RegisterReply:  # noqa: N802
        try:
            model = self.cell.model(request.model)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        request.model = model.name
        self.services[request.service_id] = request
        log.info("registered %s %s at %s for %s", agent_pb2.Role.Name(request.role), request.service_id,
                 request.address, model.name)
        spec = model.kv
        return agent_pb2.RegisterReply(
            cell_id=self.config.cell_id,
            model_dir=str(model.model_dir),
            weights_shm_name=model.weights.name if model.weights is not None else "",
            cuda_weights=model.cuda_weights,
            cuda_kv=self.cell.cuda_kv,
            scratch_block=self.cell.scratch_block,
            kv_pool=agent_pb2.KVPoolInfo(
                shm_name=self.cell.kv_store.name if self.cell.kv_store is not None else "", num_layers=spec.num_layers, num_blocks=spec.num_blocks,
                block_size=spec.block_size, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                dtype=model.kv_dtype, layout=spec.layout, offset_bytes=model.kv_offset,
            ),
            partition=self.partition.current,
            dtype=model.dtype,
            weight_format=model.weight_format.value,
            model=model.name,
            aggregated_only=self.config.never_splits,
            skip_prompt_timings=(request.role == agent_pb2.ROLE_DECODE
                                 and (self.policy is None or not self.policy.wants_prompt_timings(model.name))),
        )

    async def Allocate(self, request: agent_pb2.AllocateRequest, context: grpc.aio.ServicerContext) -> agent_pb2.AllocateReply:  # noqa: N802
        start = time.perf_counter_ns()
        try:
            alloc = self._ledger_of(request.owner).allocate(request.request_id, list(request.token_ids),
                                                            request.num_extra_tokens, owner=request.owner,
                                                            readmit=request.readmit)
        except OutOfBlocksError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"KV pool full: {exc}",
                                trailing_metadata=kv_freed_metadata(self.ledgers.num_blocks_freed))
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return agent_pb2.AllocateReply(
            block_ids=alloc.block_ids, num_cached_tokens=alloc.num_cached_tokens,
            server_ns=time.perf_counter_ns() - start,
        )

    async def Extend(self, request: agent_pb2.ExtendRequest, context: grpc.aio.ServicerContext) -> agent_pb2.ExtendReply:  # noqa: N802
        start = time.perf_counter_ns()
        try:
            ledger = self.ledgers.of_request(request.request_id)
            new = ledger.extend(request.request_id, request.num_tokens, request.owner or None)
        except OutOfBlocksError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"KV pool full: {exc}")
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        return agent_pb2.ExtendReply(new_block_ids=new, block_ids=ledger.blocks_of(request.request_id) or [],
                                     server_ns=time.perf_counter_ns() - start)

    async def Publish(self, request: agent_pb2.PublishRequest, context: grpc.aio.ServicerContext) -> agent_pb2.PublishReply:  # noqa: N802
        try:
            num = self.ledgers.of_request(request.request_id).publish(request.request_id, list(request.token_ids),
                                                                      request.owner or None)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        return agent_pb2.PublishReply(num_published=num)

    async def Release(self, request: agent_pb2.ReleaseRequest, context: grpc.aio.ServicerContext) -> agent_pb2.ReleaseReply:  # noqa: N802
        ledger = self.ledgers.of_request(request.request_id)
        return agent_pb2.ReleaseReply(num_released=ledger.release(request.request_id, list(request.token_ids),
                                                                  request.owner or None))

    async def Claim(self, request: agent_pb2.ClaimRequest, context: grpc.aio.ServicerContext) -> agent_pb2.ClaimReply:  # noqa: N802
        try:
            ended = (lambda holder: not self.leases.is_live(holder)) if request.only_from_ended_leases else None
            missing, blocks, kept = self._ledger_of(request.owner).claim(request.owner, list(request.request_ids),
                                                                         ended)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return agent_pb2.ClaimReply(missing=missing, blocks=[
            agent_pb2.BlockList(request_id=rid, block_ids=ids) for rid, ids in blocks.items()], held_by_live=kept)

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
            registered = self.services.get(request.service_id)
            self.policy.report(request, registered.model if registered is not None else "")
            await _apply_policy(self.policy, self.partition)
        return agent_pb2.ReportLoadReply(partition=self.partition.current)

    async def GetStats(self, request: agent_pb2.GetStatsRequest, context: grpc.aio.ServicerContext) -> agent_pb2.AgentStats:  # noqa: N802
        return cell_stats(self.cell, self.partition.current, self.leases)


async def _apply_policy(policy: PolicyLoop | None, partition: PartitionBoard) -> None:
    if policy is None:
        return
    change = policy.decide()
    if change is not None:
        applied, reason = change
        await partition.set(applied.prefill_cores, applied.decode_cores, reason, applied.decode_lookahead,
                            aggregated=applied.aggregated, prefill_token_budget=applied.prefill_token_budget,
                            prefill_layers=applied.prefill_layers, preempt=applied.preempt,
                            prefill_first=applied.prefill_first, prefill_held=applied.prefill_held,
                            model_token_budgets=dict(applied.model_budgets),
                            streams_decoding=applied.streams_decoding, decode_streams=applied.decode_streams,
                            spent_gap_us=applied.spent_gap_us)


async def policy_ticks(policy: PolicyLoop | None, partition: PartitionBoard, interval_s: float = 0.1) -> None:
    """Re-decide periodically too: deadlines move with time even when no report arrives."""
    while policy is not None:
        await asyncio.sleep(interval_s)
        await _apply_policy(policy, partition)


def cell_stats(cell: Cell, partition: common_pb2.Partition, leases: Leases) -> agent_pb2.AgentStats:
    """The pool's state, whole and per model (see ``AgentStats``)."""
    models = []
    for m in cell.models.values():
        alloc = m.ledger.allocator
        models.append(agent_pb2.ModelKV(
            model=m.name, num_blocks=alloc.num_blocks, num_free_blocks=alloc.num_free_blocks,
            num_requests=m.ledger.num_requests, num_held_blocks=alloc.num_used_blocks,
            num_slabs=alloc.num_slabs_held if isinstance(alloc, SlabBlockAllocator) else 0))
    allocators = [m.ledger.allocator for m in cell.models.values()]
    return agent_pb2.AgentStats(
        num_blocks=sum(m.num_blocks for m in models), num_free_blocks=sum(m.num_free_blocks for m in models),
        num_requests=sum(m.num_requests for m in models),
        num_prefix_query_tokens=sum(a.num_prefix_queries_tokens for a in allocators),
        num_prefix_hit_tokens=sum(a.num_prefix_hit_tokens for a in allocators),
        partition=partition, num_reclaimed_requests=leases.num_reclaimed_requests,
        num_reclaimed_blocks=leases.num_reclaimed_blocks, models=models,
        num_slabs=cell.slabs.num_slabs if cell.slabs is not None else 0,
        num_free_slabs=cell.slabs.num_free_slabs if cell.slabs is not None else 0,
    )


def build_state(config: AgentConfig) -> Cell:
    """Load the weights into shared memory and create the shared KV pool (the slow part)."""
    if config.device == "cuda":
        return build_cuda_cell(config.models, dtype=config.dtype, kv_dtype=config.kv_dtype, block_size=config.block_size,
                               kv_cache_bytes=int(config.kv_cache_gb * (1 << 30)), num_blocks=config.num_blocks)
    return build_cell(config.models, dtype=config.dtype, kv_dtype=config.kv_dtype, quantization=config.quantization,
                      block_size=config.block_size, kv_cache_bytes=int(config.kv_cache_gb * (1 << 30)),
                      num_blocks=config.num_blocks, shm_prefix=config.shm_prefix, kv_split=config.kv_split)
