"""``python -m prefill_svc``: the prefill service of one cell."""

from __future__ import annotations

import asyncio
import os


from prefill_svc.config import PrefillConfig, parse_args
from prefill_svc.server import PrefillServicer, PrefillWorker
from tandem.rpc.channels import bind, new_server
from tandem.rpc.tracing import service_server_interceptors, setup_tracing
from tandem.rpc.v1 import agent_pb2, prefill_pb2_grpc
from tandem.service.cell import CellMember
from tandem.service.registry import Discovery, announce, await_redis, report_load
from tandem.service.runtime import (VitalTasks, service_main, serving, setup_logging, unless_stopped,
                                    watch_agent)


async def serve(config: PrefillConfig, stop: asyncio.Event) -> None:
    log = setup_logging("tandem.prefill")
    setup_tracing("prefill_svc")
    address = f"{config.host}:{config.port}"
    member = CellMember(agent_pb2.ROLE_PREFILL, config.service_id, address, config.agent_address, model=config.model,
                        eager_attention=config.cuda_eager_attention)
    runner = await unless_stopped(member.join(), stop, f"joining the gpu_agent at {config.agent_address}")
    await await_redis(config.redis_url, stop)
    discovery = Discovery(config.redis_url, member.cell_id, model=member.model)
    decode_address = (lambda: config.decode_address) if config.decode_address else (lambda: discovery.pick("decode"))
    worker = PrefillWorker(config, member, runner, decode_address)
    server = new_server(service_server_interceptors())
    prefill_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(worker), server)
    bind(server, address)
    await server.start()
    # A failed batch loop (or discovery) leaves the registry and exits non-zero, rather than
    # staying registered while nothing is prefilled.
    tasks = VitalTasks(stop, log)
    tasks.start(worker.run(), "prefill loop")
    tasks.start(discovery.watch(), "discovery")
    tasks.start(report_load(config.redis_url, worker.load_report), "load report")
    if runner.pool.store is not None:
        tasks.start(watch_agent(runner.pool.store.name, stop), "agent watch")
    try:
        async with announce(config.redis_url, "prefill", member.cell_id, config.announced_address, config.service_id,
                            extra={"model": member.model}):
            weights = (f"weights {runner.model.weight_format.value} (private copy "
                       f"{runner.model.derived_weight_bytes / 2**20:.0f} MiB)" if member.computes else
                       "no weight copy of its own (the cell's policy never splits: decode computes every prompt)")
            serving()
            log.info("prefill_svc %s ready at %s (pid %d), cell %s, cores %s, %s", config.service_id, address,
                     os.getpid(), member.cell_id, member.units, weights)
            await stop.wait()
    finally:
        await server.stop(grace=1.0)
        await tasks.cancel()
        await worker.cancel_forwards()
        await member.close()
        await discovery.close()
        await worker.decode_channels.close()
        tasks.exit_if_failed()


def main(argv: list[str] | None = None) -> None:
    service_main("prefill_svc", parse_args, serve, argv)


if __name__ == "__main__":
    main()
