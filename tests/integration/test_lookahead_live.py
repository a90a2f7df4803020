"""decode_svc's look-ahead on the live stack (``--lookahead-ms``): decode-only steps run several
at a time when nothing waits on the loop. The streams must equal the single-process engine token
for token whatever the run lengths (requests of mixed lengths finishing mid-run, with stop token
ids, arriving while others decode), a request cancelled mid-run must return its blocks, and the
step log must show runs of more than one step."""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from pathlib import Path

import pytest

from tandem.engine.llm import LLMEngine
from tandem.engine.sampling import SamplingParams
from tandem.rpc.convert import finish_to_proto
from tests.integration.mesh_client import generate, wait_all_blocks_free
from tests.integration.stack import Stack, fault_seed

pytestmark = pytest.mark.slow
NUM_BLOCKS = 512


def test_lookahead_runs_equal_the_engine_and_free_every_block(smollm2_dir: Path, tmp_path: Path) -> None:
    seed = fault_seed()
    rng = random.Random(seed)
    step_log = tmp_path / "steps.jsonl"
    # A budget far above a step's time: every run is as long as MAX_LOOKAHEAD allows, unless a
    # request ends, has no block for its next token, or something waits on the loop.
    stack = Stack(smollm2_dir, tmp_path, num_blocks=NUM_BLOCKS,
                  extra_env={"TANDEM_LOOKAHEAD_MS": "10000", "TANDEM_STEP_LOG": str(step_log),
                             "TANDEM_CELL_ID": f"la-{uuid.uuid4().hex[:6]}"})
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(3, 60))] for _ in range(8)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 40), ignore_eos=rng.random() < 0.5,
                             stop_token_ids=tuple(rng.randrange(100, 40000) for _ in range(rng.randint(0, 3))))
              for _ in prompts]
    try:
        stack.start()

        async def run() -> list[tuple[list[int], int]]:
            address = stack.address("router")
            first = asyncio.Event()
            early = [asyncio.create_task(generate(address, p, q, first)) for p, q in zip(prompts[:4], params[:4])]
            await asyncio.wait_for(first.wait(), 60)
            late = []
            for p, q in zip(prompts[4:], params[4:], strict=True):  # arriving while the others decode
                await asyncio.sleep(rng.uniform(0.0, 0.15))
                late.append(asyncio.create_task(generate(address, p, q)))
            # one more, cancelled mid-run: its blocks must come back
            cancelled = asyncio.create_task(generate(address, prompts[0], SamplingParams(
                temperature=0.0, max_tokens=200, ignore_eos=True)))
            await asyncio.sleep(rng.uniform(0.2, 0.8))
            cancelled.cancel()
            return list(await asyncio.gather(*early, *late))

        results = asyncio.run(run())
        engine = LLMEngine.from_dir(smollm2_dir, num_blocks=256)  # the weight format the stack runs (auto)
        for (tokens, reason), prompt, q in zip(results, prompts, params, strict=True):
            (want,) = engine.generate([prompt], q)
            assert tokens == want.token_ids, f"seed {seed}"
            assert reason == finish_to_proto(want.finish_reason), f"seed {seed}"
        stats = asyncio.run(wait_all_blocks_free(stack))
        assert stats.num_free_blocks == NUM_BLOCKS and stats.num_requests == 0, f"seed {seed}"
        steps = [json.loads(line) for line in step_log.read_text().splitlines()]
        assert any(s["steps"] > 1 for s in steps), f"seed {seed}: no run of several steps"
        assert all(s["steps"] == 1 for s in steps if s["chunk_tokens"]), f"seed {seed}"
    finally:
        stack.stop()
