"""``python -m gpu_agent``: the owner of one device (a cell).

Its shared-memory stores are named ``<cell_id>-<instance_id>-*`` and guarded by an owner lock
(:mod:`tandem.engine.shm_files`): this incarnation removes them when it stops, and a successor,
or the launcher, removes them if it died. A new incarnation has a new, empty KV pool: the
requests its cell was decoding go on all the same, since the restarted decode_svc resumes them
from their Redis records and, finding no blocks for them in this agent's ledger, recomputes
their K/V (prefill's requests fail with the prefill_svc that is restarted with the cell).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time


from gpu_agent.config import AgentConfig, parse_args
from gpu_agent.policy_loop import PolicyLoop, live_dynamic
from gpu_agent.models import Cell
from gpu_agent.server import GpuAgentServicer, PartitionBoard, build_state, cell_stats, policy_ticks
from tandem.engine.shm_files import SHM_DIR, OwnerLock, sweep_dead_owners
from tandem.perf.predictor import cpu_predictor
from tandem.policy.policies import ChunkedConfig, ChunkedPolicy, get_policy
from tandem.policy.types import Slo
from tandem.rpc.channels import bind, new_server
from tandem.rpc.tracing import service_server_interceptors, setup_tracing
from tandem.rpc.v1 import agent_pb2_grpc, common_pb2
from tandem.service.registry import announce, await_redis, report_load
from tandem.service.runtime import VitalTasks, last_words, service_main, serving, setup_logging
from tandem.state.schema import LoadReport

async def serve(config: AgentConfig, stop: asyncio.Event) -> None:
    log = setup_logging("tandem.gpu_agent")
    setup_tracing("gpu_agent")
    # Lock first, then sweep: a sweeper (ours or another stack's) never mistakes this
    # incarnation's files, created only under the lock, for a dead owner's.
    owner = OwnerLock.acquire(config.shm_prefix)
    # A policy loop that raises would freeze the partition while the cell looks healthy.
    tasks = VitalTasks(stop, log)
    try:
        for prefix, files in sweep_dead_owners(f"{config.cell_id}-").items():
            log.warning("removed %d shared-memory files of a dead agent (%s)", len(files), prefix)

        def release_at_forced_exit() -> None:  # should the shutdown hang, still remove them
            log.warning("gpu_agent %s forced to exit; removed %d shared-memory files", config.cell_id,
                        len(owner.release()))

        with last_words(release_at_forced_exit):
            await _serve(config, stop, log, tasks)
    finally:
        removed = owner.release()
        log.info("gpu_agent %s stopped; removed %d shared-memory files", config.cell_id, len(removed))
        tasks.exit_if_failed()


async def _serve(config: AgentConfig, stop: asyncio.Event, log: logging.Logger, tasks: VitalTasks) -> None:
    started = time.perf_counter()
    cell = await asyncio.to_thread(build_state, config)
    await await_redis(config.redis_url, stop)  # a Redis restarting meanwhile is waited for, not an exit
    cores = sorted(set(config.prefill_cores) | set(config.decode_cores))
    if config.never_splits:
        # Aggregated from the start, so no request is prefilled apart before the first decision.
        initial = common_pb2.Partition(epoch=1, decode_units=cores, decode_lookahead=1, policy="chunked",
                                       aggregated=True)
    else:
        initial = common_pb2.Partition(epoch=1, prefill_units=config.prefill_cores,
                                       decode_units=config.decode_cores, decode_lookahead=1, policy="static")
    partition = PartitionBoard(initial)
    policy = None
    if config.policy != "static":
        # The static policy is the split from the flags; the others re-split on live load (predicting
        # from the cell's first model when it serves several).
        model_config = cell.first.config
        chosen = get_policy(config.policy)
        chunked = ChunkedConfig(tbt_target=config.chunk_tbt_target, floor_within_slo=config.chunk_floor_within_slo,
                                floor_tbt_target=config.chunk_floor_tbt_target,
                                ttft_deadlines=config.chunk_ttft_deadlines,
                                spent_tbt_target=config.chunk_spent_tbt_target)
        if config.policy == "chunked":
            chosen = ChunkedPolicy(chunked)
        if config.policy == "dynamic":
            chosen = live_dynamic(config.split_rate_check, chunked)
        policy = PolicyLoop(config.policy, chosen, cpu_predictor(model_config, len(cores), config.profile),
                            cores, model_config.num_layers, Slo(config.ttft_slo_ms / 1000, config.tbt_slo_ms / 1000,
                                                                      config.ttft_slo_ms_per_1k / 1000),
                            calibrate_split=config.split_calibration, kv_blocks=cell.kv_blocks_free,
                            predicted_model=cell.first.name, stats_s=config.step_stats_s, chunked=chunked)
    servicer = GpuAgentServicer(config, cell, partition, policy)
    server = new_server(service_server_interceptors())
    agent_pb2_grpc.add_GpuAgentServicer_to_server(servicer, server)
    address = f"{config.host}:{config.port}"
    bind(server, address)
    await server.start()

    def load_report() -> LoadReport:
        stats = cell_stats(cell, partition.current, servicer.leases)
        kv_by_model = {name: m.ledger.kv_load() for name, m in cell.models.items()}
        # The first model's figures at the top level too, for routers that predate the map.
        first = next(iter(kv_by_model.values()))
        return LoadReport.now(f"agent-{config.cell_id}", config.cell_id, "agent", partition.current,
                              stats.num_blocks, kv_free_blocks=stats.num_free_blocks, num_running=stats.num_requests,
                              kv_used_by_model=cell.kv_used_by_model(), kv_block_size=first.block_size,
                              kv_held_back_blocks=first.held_back_blocks,
                              kv_prompt_blocks_granted=first.prompt_blocks_granted, kv_by_model=kv_by_model,
                              prompt_rate_beside=None if policy is None else policy.prompt_rate)

    tasks.start(report_load(config.redis_url, load_report), "load report")
    tasks.start(policy_ticks(policy, partition), "policy loop")
    try:
        async with announce(config.redis_url, "agent", config.cell_id, address, f"agent-{config.cell_id}"):
            serving()
            log.info(
                "gpu_agent %s ready at %s (pid %d): %s, %s, loaded in %.1fs, %s",
                config.cell_id, address, os.getpid(), ", ".join(cell.models), _describe_kv(cell),
                time.perf_counter() - started,
                f"shared memory {SHM_DIR / f'tandem-{config.shm_prefix}-*'}" if cell.kv_store is not None
                else "weights and KV pool in GPU memory, handed out as CUDA IPC handles",
            )
            await stop.wait()
    finally:
        await server.stop(grace=1.0)
        await tasks.cancel()


def _describe_kv(cell: Cell) -> str:
    first = cell.first.kv
    if cell.slabs is None:
        return f"{first.num_blocks} KV blocks of {first.block_size} tokens"
    per_model = ", ".join(f"{m.name} {cell.slabs.blocks_per_slab(m.name)} blocks of {m.kv.bytes_per_block} B"
                          for m in cell.models.values())
    return f"KV slab pool of {cell.slabs.num_slabs} slabs of {cell.slabs.slab_bytes} bytes ({per_model} per slab)"


def main(argv: list[str] | None = None) -> None:
    service_main("gpu_agent", parse_args, serve, argv)


if __name__ == "__main__":
    main()
