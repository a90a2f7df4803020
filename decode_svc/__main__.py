"""``python -m decode_svc``: the decode service of one cell."""

from __future__ import annotations

import asyncio
import os

import grpc

from decode_svc.config import DecodeConfig, parse_args
from decode_svc.server import DecodeServicer, DecodeWorker
from tandem.engine.quant import WeightFormat
from tandem.rpc.tracing import service_server_interceptors, setup_tracing
from tandem.rpc.v1 import agent_pb2, decode_pb2_grpc
from tandem.service.cell import CellMember
from tandem.service.registry import announce, open_redis, report_load
from tandem.service.runtime import VitalTasks, service_main, setup_logging, watch_agent
from tandem.state.request_store import RequestStore


async def serve(config: DecodeConfig, stop: asyncio.Event) -> None:
    log = setup_logging("tandem.decode")
    setup_tracing("decode_svc")
    address = f"{config.host}:{config.port}"
    member = CellMember(agent_pb2.ROLE_DECODE, config.service_id, address, config.agent_address,
                        weight_format=WeightFormat.parse(config.quantization) if config.quantization else None,
                        model=config.model)
    runner = await member.join()
    redis = open_redis(config.redis_url)
    records = RequestStore(redis) if redis is not None else None
    worker = DecodeWorker(config, member, runner, records)
    if config.resume:
        resumed = await worker.resume()
        if resumed:
            log.info("resumed %d decoding requests from Redis", resumed)
    server = grpc.aio.server(interceptors=service_server_interceptors())
    decode_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(worker), server)
    server.add_insecure_port(address)
    await server.start()
    # The decode loop never ends by itself: if it raises, this process can no longer serve, so
    # it leaves the registry and exits non-zero (its requests resume from Redis in its successor)
    # instead of staying up, registered and silent.
    tasks = VitalTasks(stop, log)
    tasks.start(worker.run(), "decode loop")
    tasks.start(report_load(config.redis_url, worker.load_report), "load report")
    if runner.pool.store is not None:
        tasks.start(watch_agent(runner.pool.store.name, stop), "agent watch")
    try:
        async with announce(config.redis_url, "decode", member.cell_id, config.announced_address, config.service_id,
                            extra={"model": member.model}):
            log.info("decode_svc %s ready at %s (pid %d), cell %s, cores %s, weights %s (private copy %.0f MiB)",
                     config.service_id, address, os.getpid(), member.cell_id, member.units,
                     runner.model.weight_format.value, runner.model.derived_weight_bytes / 2**20)
            await stop.wait()
    finally:
        await server.stop(grace=1.0)
        await tasks.cancel()
        await member.close()
        if redis is not None:
            await redis.aclose()
        tasks.exit_if_failed()


def main(argv: list[str] | None = None) -> None:
    service_main("decode_svc", parse_args, serve, argv)


if __name__ == "__main__":
    main()
