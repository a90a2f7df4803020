"""decode_svc in aggregated mode: a prompt whose last chunk ran in a step answers its Handoff and
joins the decode batch at once, while its prompt's blocks are published to the agent's prefix
cache; the blocks go back only after that Publish. Publishing first (one agent round trip per
prompt, one after the other, on cores busy with the steps) kept a burst of seven prompts out of
the batch for 16 steps in a live stack at concurrency 8 on 2026-11-28.

The worker is built without a model, and its agent is a stand-in whose Publish waits until the
test lets it go: an agent slowed by busy cores cannot be reproduced on demand, and only the
order of the calls is under test. The live path (a real agent) runs in test_aggregated_live.py.
"""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from decode_svc.server import DecodeWorker, _Active
from tandem.engine.sampling import SamplingParams
from tandem.engine.step import Request, StepOutput


class _SlowAgent:
    """Publish returns once ``go`` is set; Release is recorded at once."""

    def __init__(self, calls: list[tuple[str, str]]) -> None:
        self.go = asyncio.Event()
        self.calls = calls

    async def Publish(self, request, timeout: float):  # type: ignore[no-untyped-def]  # noqa: N802
        await self.go.wait()
        self.calls.append(("publish", request.request_id))


def _worker(calls: list[tuple[str, str]]) -> DecodeWorker:
    worker = DecodeWorker.__new__(DecodeWorker)  # only what _first_token and _finish touch
    agent = _SlowAgent(calls)

    async def release(request_id: str, token_ids: list[int]) -> None:
        calls.append(("release", request_id))

    worker.member = SimpleNamespace(agent=agent, release=release)  # type: ignore[assignment]
    worker.config = SimpleNamespace(service_id="decode-test")  # type: ignore[assignment]
    worker.running, worker.prefilling, worker.preempted, worker.pending = [], [], [], []
    worker.by_id, worker._prefill_done_unix_ns = {}, {}
    worker._publishing = None
    worker._unrecorded = set()
    worker._gone_routers = set()
    worker.records = None
    worker._wake = asyncio.Event()
    worker._readmit_after_ns = 0
    return worker


@pytest.mark.parametrize("seed", range(8))
def test_a_finished_prompt_decodes_before_its_publish_returns(seed: int) -> None:
    rng = random.Random(seed)

    async def main() -> None:
        calls: list[tuple[str, str]] = []
        worker = _worker(calls)
        loop = asyncio.get_running_loop()
        actives = []
        for i in range(rng.randint(1, 9)):
            prompt = [rng.randint(1, 500) for _ in range(rng.randint(2, 80))]
            req = Request(f"r{seed}-{i}", prompt, SamplingParams(max_tokens=rng.randint(2, 64)), None)
            req.num_computed_tokens = len(prompt)
            req.block_ids = list(range(i * 8, i * 8 + 6))
            active = _Active(req, "router", num_sent=1, handed_ns=1)
            active.first_token = loop.create_future()
            worker.by_id[req.request_id] = active
            actives.append(active)
        for active in actives:  # as _publish does for the prompts a step finished
            await asyncio.wait_for(worker._first_token(active, StepOutput(active.req.request_id, 7, None, None,
                                                                          None)), timeout=1.0)
        # Every prompt decodes and has its first token while no Publish has returned.
        assert worker.running == actives
        assert all(a.first_token is not None and a.first_token.done() for a in actives)
        assert all(a.first_token.result().first_token.token_id == 7 for a in actives)  # type: ignore[union-attr]
        assert calls == []
        # A request that ends now gives its blocks back only after its prompt is published.
        ending = rng.sample(actives, rng.randint(1, len(actives)))
        finishing = [loop.create_task(worker._finish(a, "length", send=False)) for a in ending]
        await asyncio.sleep(0.01)
        assert calls == []
        worker.member.agent.go.set()  # type: ignore[attr-defined]
        await asyncio.wait_for(asyncio.gather(*finishing), timeout=1.0)
        for active in ending:
            rid = active.req.request_id
            assert calls.index(("publish", rid)) < calls.index(("release", rid))
        assert [a for a in actives if a not in ending] == worker.running

    asyncio.run(main())
