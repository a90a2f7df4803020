"""``python -m decode_svc``: the decode service of one cell."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING


from decode_svc.config import DecodeConfig, parse_args
from decode_svc.server import DecodeServicer, DecodeWorker
from tandem.engine.quant import WeightFormat
from tandem.engine.runner import ModelRunner
from tandem.rpc.channels import bind, new_server
from tandem.rpc.tracing import service_server_interceptors, setup_tracing
from tandem.rpc.v1 import agent_pb2, decode_pb2_grpc
from tandem.service.cell import CellMember
from tandem.service.registry import announce, await_redis, open_redis, report_load
from tandem.service.runtime import (VitalTasks, service_main, serving, setup_logging, unless_stopped,
                                    watch_agent, watch_progress)
from tandem.state.request_store import RequestStore

if TYPE_CHECKING:
    from tandem.cuda.graphs import ServiceGraphs


async def serve(config: DecodeConfig, stop: asyncio.Event) -> None:
    log = setup_logging("tandem.decode")
    setup_tracing("decode_svc")
    address = f"{config.host}:{config.port}"
    member = CellMember(agent_pb2.ROLE_DECODE, config.service_id, address, config.agent_address,
                        weight_format=WeightFormat.parse(config.quantization) if config.quantization else None,
                        model=config.model, eager_attention=config.cuda_eager_attention)
    runner = await unless_stopped(member.join(), stop, f"joining the gpu_agent at {config.agent_address}")
    graphs = await _graphs(config, member, runner, log)
    await await_redis(config.redis_url, stop)  # its records are read (resume) and written from here on
    redis = open_redis(config.redis_url)
    records = RequestStore(redis) if redis is not None else None
    worker = DecodeWorker(config, member, runner, records, graphs)
    if config.resume:
        resumed = await worker.resume()
        if resumed:
            log.info("resumed %d decoding requests from Redis", resumed)
    server = new_server(service_server_interceptors())
    decode_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(worker), server)
    bind(server, address)
    await server.start()
    worker.start_serving()
    # The decode loop never ends by itself: if it raises, this process can no longer serve, so
    # it leaves the registry and exits non-zero (its requests resume from Redis in its successor)
    # instead of staying up, registered and silent.
    tasks = VitalTasks(stop, log)
    tasks.start(worker.run(), "decode loop")
    tasks.start(watch_progress(f"{config.service_id}'s decode loop", lambda: worker.num_steps, worker.work_left, log,
                               more=worker.stall_lines), "progress watch")
    tasks.start(report_load(config.redis_url, worker.load_report), "load report")
    if runner.pool.store is not None:
        tasks.start(watch_agent(runner.pool.store.name, stop), "agent watch")
    try:
        async with announce(config.redis_url, "decode", member.cell_id, config.announced_address, config.service_id,
                            extra={"model": member.model}):
            serving()
            log.info("decode_svc %s ready at %s (pid %d), cell %s, cores %s, weights %s (private copy %.0f MiB)",
                     config.service_id, address, os.getpid(), member.cell_id, member.units,
                     runner.model.weight_format.value, runner.model.derived_weight_bytes / 2**20)
            await stop.wait()
    finally:
        await server.stop(grace=1.0)
        await tasks.cancel()
        worker.close_step_log()
        await member.close()
        if redis is not None:
            await redis.aclose()
        tasks.exit_if_failed()


async def _graphs(config: DecodeConfig, member: CellMember, runner: ModelRunner,
                  log: logging.Logger) -> ServiceGraphs | None:
    """A CUDA cell's decode steps from CUDA graphs (``--cuda-graphs``), the common buckets of
    the first partition's stream captured before the service says it is ready; steps with
    prompt tokens (hybrid, recomputing) through piecewise graphs (``tandem.cuda.piecewise``)."""
    if not config.cuda_graphs or runner.model.device.type != "cuda":
        return None
    if member.scratch_block is None:
        log.warning("the cell's agent reserves no scratch block: decoding without CUDA graphs")
        return None
    from tandem.cuda.graphs import ServiceGraphs, resolve_graph_attention
    from tandem.cuda.piecewise import PiecewiseForward

    attention, why = resolve_graph_attention(config.cuda_attention, runner.pool, runner.model.dtype)
    log.info("%s: CUDA-graph decode steps attend with %s (--cuda-attention %s: %s)", config.service_id, attention,
             config.cuda_attention, why)

    def build(attention: str = attention) -> ServiceGraphs:
        import torch

        graphs = ServiceGraphs(runner.model, runner.pool, scratch_block=member.scratch_block or 0,
                               max_rows=config.max_batch_requests,
                               max_context=runner.config.max_position_embeddings, attention=attention)
        # The stream in force gets the buckets up to 64 rows, every other stream decode may be
        # switched to those up to 32 (contexts up to 4096 tokens), so that a partition change
        # rarely pays for a capture within a step (on the H100, `dynamic` decoded on a side
        # warmed to 8 rows only, and its steps of 9-16 rows captured there, under load, in the
        # middle of the run); larger ones are captured on first use.
        blocks = -(-4096 // runner.pool.spec.block_size)
        for i, stream in enumerate(member.phase_streams()):
            with torch.cuda.stream(stream):
                graphs.warm(64 if i == 0 else 32, blocks)
        return graphs

    def build_pieces() -> PiecewiseForward:
        pieces = PiecewiseForward(runner.model, runner.pool)
        pieces.warm()  # on the stream in force; steps with prompt tokens on others capture there
        return pieces

    try:
        graphs = await member.run(build)
    except Exception:
        if attention != "flashinfer" or config.cuda_attention != "auto":
            raise
        # flashinfer imports but failed to build or capture (its JIT needs nvcc): torch's attention serves
        log.exception("%s: CUDA graphs with flashinfer's attention failed; capturing them with torch's",
                      config.service_id)
        graphs = await member.run(lambda: build("torch"))
    log.info("%s captured %d CUDA graphs (%s attention) in %.1f s (batch buckets %s, context buckets %s blocks)",
             config.service_id, graphs.num_graphs, graphs.attention, graphs.capture_s, graphs.batch_buckets,
             graphs.block_buckets)
    try:
        pieces = await member.run(build_pieces)
    except Exception:  # decode still serves: steps with prompt tokens run op by op
        log.exception("%s: capturing piecewise CUDA graphs failed; steps with prompt tokens run op by op",
                      config.service_id)
        return graphs
    runner.piecewise = pieces
    log.info("%s captured %d piecewise CUDA graphs for steps with prompt tokens in %.1f s (token buckets %s)",
             config.service_id, pieces.num_graphs, pieces.capture_s, pieces.buckets)
    return graphs


def main(argv: list[str] | None = None) -> None:
    service_main("decode_svc", parse_args, serve, argv)


if __name__ == "__main__":
    main()
