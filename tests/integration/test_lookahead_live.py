"""decode_svc's look-ahead on the live stack (``--lookahead-ms``): decode-only steps run several
at a time when nothing waits on the loop. The streams must equal the single-process engine token
for token whatever the run lengths (requests of mixed lengths finishing mid-run, with stop token
ids, arriving while others decode), a request cancelled mid-run must return its blocks, the step
log must show runs of more than one step (on a quiet load of two streams when the random one
happened to cut every run short), and a decode_svc killed mid-run must resume from its
Redis records (a run's tokens and seeded generator states, written once a run) without a token
lost or repeated. Some requests keep to a grammar (structured output) throughout."""

from __future__ import annotations

import asyncio
import json
import random
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.engine.grammar import grammar_for
from tandem.engine.llm import LLMEngine
from tandem.engine.sampling import SamplingParams
from tandem.rpc.convert import finish_to_proto
from tests.integration.mesh_client import generate, wait_all_blocks_free
from tests.integration.stack import Stack, fault_seed

pytestmark = pytest.mark.slow
NUM_BLOCKS = 512


@pytest.fixture(scope="module")
def step_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lookahead") / "steps.jsonl"


@pytest.fixture(scope="module")
def stack(smollm2_dir: Path, step_log: Path) -> Iterator[Stack]:
    # A budget far above a step's time: every run is as long as MAX_LOOKAHEAD allows, unless a
    # request ends, has no block for its next token, or something waits on the loop.
    with Stack(smollm2_dir, step_log.parent, num_blocks=NUM_BLOCKS,
               extra_env={"TANDEM_LOOKAHEAD_MS": "10000", "TANDEM_STEP_LOG": str(step_log),
                          "TANDEM_CELL_ID": f"la-{uuid.uuid4().hex[:6]}"}) as s:
        yield s


@pytest.fixture(scope="module")
def engine(smollm2_dir: Path) -> LLMEngine:
    return LLMEngine.from_dir(smollm2_dir, num_blocks=256)  # the weight format the stack runs (auto)


# Structured outputs a request may keep to: its matcher is rebuilt from the output wherever the
# request goes (prefill's first token, decode, a restarted decode resuming it).
GRAMMARS = [
    grammar_for("json", {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                                          "tags": {"type": "array", "items": {"type": "string"}}},
                         "required": ["name", "tags"]}),
    grammar_for("json_object", None),
    grammar_for("regex", r"([a-z]+ ){1,40}[0-9]{1,4}"),
    grammar_for("choice", ["yes", "no", "it depends"]),
]


def _params(rng: random.Random, max_tokens: tuple[int, int]) -> SamplingParams:
    """Greedy or seeded sampling, a random length, maybe EOS and stop ids, maybe a grammar."""
    sampled = rng.random() < 0.5
    return SamplingParams(temperature=0.8 if sampled else 0.0, seed=rng.randrange(1, 2**31) if sampled else None,
                          max_tokens=rng.randint(*max_tokens), ignore_eos=rng.random() < 0.5,
                          stop_token_ids=tuple(rng.randrange(100, 40000) for _ in range(rng.randint(0, 3))),
                          grammar=rng.choice(GRAMMARS) if rng.random() < 0.4 else "")


def _check(engine: LLMEngine, results: list[tuple[list[int], int]], prompts: list[list[int]],
           params: list[SamplingParams], seed: int) -> None:
    for (tokens, reason), prompt, q in zip(results, prompts, params, strict=True):
        (want,) = engine.generate([prompt], q)
        assert tokens == want.token_ids, f"seed {seed}"  # nothing lost, nothing repeated
        assert reason == finish_to_proto(want.finish_reason), f"seed {seed}"


def test_lookahead_runs_equal_the_engine_and_free_every_block(stack: Stack, engine: LLMEngine,
                                                              step_log: Path) -> None:
    seed = fault_seed()
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(3, 60))] for _ in range(8)]
    params = [_params(rng, (1, 40)) for _ in prompts]

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

    _check(engine, asyncio.run(run()), prompts, params, seed)
    stats = asyncio.run(wait_all_blocks_free(stack))
    assert stats.num_free_blocks == NUM_BLOCKS and stats.num_requests == 0, f"seed {seed}"
    steps = [json.loads(line) for line in step_log.read_text().splitlines()]
    if not any(s["steps"] > 1 for s in steps):
        # Under a loaded host something (an arrival, a request ending, a block to grow) may have
        # cut every run of that load to one step; a quiet load must then show runs: two greedy
        # streams together, nothing arriving, nothing ending for dozens of steps.
        quiet = prompts[:2]
        quiet_params = [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True) for _ in quiet]

        async def quiet_run() -> list[tuple[list[int], int]]:
            return list(await asyncio.gather(*(generate(stack.address("router"), p, q)
                                               for p, q in zip(quiet, quiet_params, strict=True))))

        _check(engine, asyncio.run(quiet_run()), quiet, quiet_params, seed)
        steps = [json.loads(line) for line in step_log.read_text().splitlines()]
    assert any(s["steps"] > 1 for s in steps), f"seed {seed}: no run of several steps, even on a quiet load"
    assert all(s["steps"] == 1 for s in steps if s["chunk_tokens"]), f"seed {seed}"
    assert all(s["policy"] for s in steps), f"seed {seed}: a step without the partition's policy"
    # decode's start-up timings reached the agent's predictor
    assert re.search(r"timed prompts of 32 \(\d+ ms\), 256 \(\d+ ms\) tokens", stack.logs("gpu_agent"))


def test_decode_killed_mid_run_resumes_without_loss_or_repeat(stack: Stack, engine: LLMEngine) -> None:
    seed = fault_seed()
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(3, 40))] for _ in range(4)]
    params = [_params(rng, (100, 160)) for _ in prompts]

    async def run() -> list[tuple[list[int], int]]:
        started = asyncio.Event()
        tasks = [asyncio.create_task(generate(stack.address("router"), p, q, started))
                 for p, q in zip(prompts, params, strict=True)]
        await asyncio.wait_for(started.wait(), 60)
        await asyncio.sleep(rng.uniform(0.3, 1.5))
        stack.kill("decode_svc")
        await asyncio.sleep(rng.uniform(0.0, 0.5))
        await asyncio.to_thread(stack.start_process, "decode_svc")
        return list(await asyncio.gather(*tasks))

    _check(engine, asyncio.run(run()), prompts, params, seed)
    stats = asyncio.run(wait_all_blocks_free(stack))
    assert stats.num_free_blocks == NUM_BLOCKS and stats.num_requests == 0, f"seed {seed}"
