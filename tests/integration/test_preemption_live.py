"""MuxWise preemption on the live stack (issue 13): a long prompt is paused between layer groups
for a short one whose deadline it would make it miss, and both complete with the in-process
engine's greedy output. Deadlines grow with the prompt (TANDEM_TTFT_SLO_MS_PER_1K), so the short
prompt's is far earlier than the long one's."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from tandem.engine.llm import LLMEngine
from tandem.engine.sampling import SamplingParams
from tests.integration.mesh_client import generate, wait_all_blocks_free
from tests.integration.stack import Stack

pytestmark = pytest.mark.slow


def test_a_long_prefill_pauses_for_a_short_prompt_and_both_are_exact(smollm2_dir: Path, tmp_path: Path) -> None:
    rng = random.Random()
    long_ids = [rng.randrange(100, 40000) for _ in range(1800)]
    short_ids = [rng.randrange(100, 40000) for _ in range(rng.randint(8, 40))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    # A group of 3 layers of the long prompt takes ~0.7 s here: the short prompt can wait for one
    # boundary and still make its 3 s, but not for the whole long prefill (~7 s).
    env = {"TANDEM_TTFT_SLO_MS": "3000", "TANDEM_TTFT_SLO_MS_PER_1K": "4000", "TANDEM_LAYER_GROUP_SIZE": "3"}
    with Stack(smollm2_dir, tmp_path, num_blocks=512, extra_env=env) as stack:
        async def run() -> tuple[tuple[list[int], int], tuple[list[int], int]]:
            address = stack.address("router")
            long_task = asyncio.create_task(generate(address, long_ids, params))
            # Once the long prompt is computing (its first layer group is reported running).
            await asyncio.to_thread(stack.wait_log, "prefill_svc", "applied partition", 60)
            await asyncio.sleep(0.8)
            short = await generate(address, short_ids, params)
            result = await long_task, short
            stats = await wait_all_blocks_free(stack)
            assert stats.num_free_blocks == stats.num_blocks
            return result

        (long_out, _), (short_out, _) = asyncio.run(run())
        prefill_log, agent_log = stack.logs("prefill_svc"), stack.logs("gpu_agent")
    assert "preemption:" in agent_log, agent_log[-3000:]
    assert "paused after" in prefill_log, prefill_log[-3000:]
    engine = LLMEngine.from_dir(smollm2_dir, num_blocks=256)
    want_long, want_short = engine.generate([long_ids, short_ids], params)
    assert long_out == want_long.token_ids
    assert short_out == want_short.token_ids
