"""`tandem up --deployment FILE` (issue 14): placement's cells run on this machine, one core each,
behind one router that routes by model.

Two models whose footprints cannot share a 1 GiB cell: FineServe's placement puts them on cells
cpu0 and cpu1, each cell gets its own agent (its own KV pool) on its own core, and one router
serves both; each answers with its own engine's greedy output, and SIGTERM removes every
shared-memory file of both cells.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from pathlib import Path

import grpc
import httpx
import pytest
import torch

from tandem.engine.llm import LLMEngine
from tandem.engine.sampling import SamplingParams
from tandem.rpc.convert import sampling_to_proto
from tandem.rpc.v1 import agent_pb2, agent_pb2_grpc, router_pb2, router_pb2_grpc
from tandem.service.runtime import free_ports
from tests.integration.stack import start_up, stop_up

pytestmark = pytest.mark.slow


def _profile(name: str, serve: str) -> dict[str, object]:
    return {"name": name, "serve": serve, "rate_rps": 1.0, "ttft_slo_ms": 3000, "weight_gib": 0.6,
            "activation_gib": 0.05, "kv_gib": 0.1, "mme": 10.0}


async def _generate(address: str, model: str, ids: list[int], params: SamplingParams) -> list[int]:
    async with grpc.aio.insecure_channel(address) as channel:
        request = router_pb2.GenerateRequest(model=model, token_ids=router_pb2.TokenIds(ids=ids),
                                             sampling=sampling_to_proto(params))
        return [t.token_id async for r in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=300)
                for t in r.tokens]


async def _models_of(agent_address: str) -> list[str]:
    async with grpc.aio.insecure_channel(agent_address) as channel:
        stats = await agent_pb2_grpc.GpuAgentStub(channel).GetStats(agent_pb2.GetStatsRequest(), timeout=5)
        return [m.model for m in stats.models]


def test_a_deployment_runs_each_placed_cell_behind_one_router(smollm2_dir: Path, tmp_path: Path) -> None:
    prefix = f"dp{uuid.uuid4().hex[:4]}"
    deployment = {"hardware": "H100-SXM", "kv_cache_gb": 0.05,
                  "cells": [{"name": prefix, "count": 2, "memory_gib": 1.0}],
                  "models": [_profile("fp32kv", str(smollm2_dir)), _profile("bf16kv", f"{smollm2_dir}:kv=bfloat16")]}
    path = tmp_path / "deployment.json"
    path.write_text(json.dumps(deployment))
    grpc_port, http_port = free_ports(2)
    log_path = tmp_path / "up.log"
    proc = start_up(["--deployment", str(path), "--grpc-port", str(grpc_port), "--port", str(http_port),
                     "--admission", "off", "--quantization", "auto"], log_path)
    try:
        text = log_path.read_text(errors="replace")
        agents = dict(re.findall(r"tandem up: gpu_agent\[(\S+)\] ready at (\S+)", text))
        assert sorted(agents) == [f"{prefix}0", f"{prefix}1"], text[-3000:]
        assert {tuple(asyncio.run(_models_of(address))) for address in agents.values()} == {("fp32kv",), ("bf16kv",)}
        listed = httpx.get(f"http://127.0.0.1:{http_port}/v1/models", timeout=10).json()
        assert sorted(m["id"] for m in listed["data"]) == ["bf16kv", "fp32kv"]
        prompt = list(range(300, 340))
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

        async def both() -> list[list[int]]:
            return await asyncio.gather(*(_generate(f"127.0.0.1:{grpc_port}", m, prompt, params)
                                          for m in ("fp32kv", "bf16kv")))

        fp32, bf16 = asyncio.run(both())
        assert fp32 == LLMEngine.from_dir(smollm2_dir, num_blocks=64).generate([prompt], params)[0].token_ids
        want_bf16 = LLMEngine.from_dir(smollm2_dir, num_blocks=64, kv_dtype=torch.bfloat16).generate([prompt], params)
        assert bf16 == want_bf16[0].token_ids
    finally:
        stop_up(proc, log_path)
    assert not list(Path("/dev/shm").glob(f"tandem-{prefix}*"))
