"""The router core feeds the stream cap the gaps between a stream's updates that carry tokens,
and nothing else: an error update that ends a stream after a stall (a decode service killed,
its successor failing the streams it could not resume) is no gap of decode's steps. Before,
the errors that ended the streams of a dead decode service counted as gaps of the stall's
length, and a handful of them cut the cap for the streams that came after the fault.

The upstream is a test double (``FakeUpstream``): it answers ``submit`` with a first token at
once and gives the test each request's update queue, which the real one fills from decode's
token stream. Everything else is the real router core, admission and stream cap."""

from __future__ import annotations

import asyncio
import math
import random
import time
from pathlib import Path

import pytest

from router.admission import AdmissionController
from router.config import RouterConfig
from router.core import RouterCore
from router.metrics import RouterMetrics
from tandem.engine.config import ModelConfig
from tandem.engine.tokenizer import Tokenizer
from tandem.policy.admission import StreamLimit
from tandem.policy.types import Slo
from tandem.protocol import RequestError
from tandem.rpc.v1 import common_pb2, decode_pb2, prefill_pb2, router_pb2
from tests.unit.test_admission import TokenPredictor

TBT_S = 0.1


class FakeUpstream:
    """A test double for ``router.upstream.Upstream`` (no prefill or decode service runs in a
    unit test): ``submit`` replies with a first token, and ``queues`` holds each request's
    queue of decode updates for the test to fill."""

    def __init__(self) -> None:
        self.queues: dict[str, asyncio.Queue[decode_pb2.TokenUpdate]] = {}
        self.streams = self
        self.last_opened_s = -math.inf  # DecodeStreams': when a decode stream last (re)opened
        self.submitted = asyncio.Event()

    def register(self, upstream_id: str) -> asyncio.Queue[decode_pb2.TokenUpdate]:
        self.queues[upstream_id] = asyncio.Queue()
        return self.queues[upstream_id]

    def unregister(self, upstream_id: str) -> None:
        self.queues.pop(upstream_id, None)

    async def pick_prefill(self, deadline_s: float, avoid: str = "") -> str:
        return "prefill:1"

    async def submit(self, address: str, upstream_id: str, *args: object) -> prefill_pb2.PrefillReply:
        self.submitted.set()
        return prefill_pb2.PrefillReply(request_id=upstream_id, first_token=common_pb2.GeneratedToken(token_id=42),
                                        prefill_ns=1_000_000, handoff_ns=1_000)

    def cancel_soon(self, upstream_id: str, prefill_address: str) -> None:
        pass

    async def close(self) -> None:
        pass


def _core(smollm2_dir: Path, upstream: FakeUpstream) -> tuple[RouterCore, AdmissionController]:
    config = RouterConfig(model_dir=smollm2_dir, host="127.0.0.1", grpc_port=0, prefill_addresses=("h:1",),
                          decode_addresses=("h:2",), redis_url="", cell_id="c", router_id="r",
                          stall_timeout_s=30, request_timeout_s=60)
    # A check at every gap (a tiny interval): the stalled streams' updates, which come together,
    # are judged one by one as they come, so a few of them are enough to move the quantile.
    admission = AdmissionController(TokenPredictor(), Slo(ttft_s=10.0, tbt_s=TBT_S), enabled=True,
                                    default_units=1, streams=StreamLimit(TBT_S, min_gaps=4, interval_s=1e-6))
    tokenizer, model_config = Tokenizer.from_dir(smollm2_dir), ModelConfig.from_dir(smollm2_dir)
    core = RouterCore(config, tokenizer, model_config, upstream,  # type: ignore[arg-type]
                      RouterMetrics().for_model("m"), admission, model_id="m")
    return core, admission


def _update(index: int, tokens: int = 1, error: str = "", prompt_step: bool = False) -> decode_pb2.TokenUpdate:
    if error:
        return decode_pb2.TokenUpdate(first_index=index, finish_reason=common_pb2.FINISH_REASON_ERROR, error=error,
                                      error_status="UNAVAILABLE")
    return decode_pb2.TokenUpdate(first_index=index, prompt_step=prompt_step,
                                  tokens=[common_pb2.GeneratedToken(token_id=7) for _ in range(tokens)])


@pytest.mark.parametrize("seed", range(3))
def test_an_error_after_a_stall_is_no_gap_for_the_stream_cap(smollm2_dir: Path, seed: int) -> None:
    """Streams step well within the TBT SLO, then stall far past it and end with an error (a
    killed decode): the cap is not cut. The same stall with tokens after it (a slow step) is a
    gap, and cuts it; unless decode flags that step as one a prompt chunk sized
    (``TokenUpdate.prompt_step``): that gap counts no further than the cut's threshold; or a
    decode stream (re)opened within the stall (``DecodeStreams.last_opened_s``: a successor
    resumed the streams), and the gap is the outage's."""
    rng = random.Random(seed)

    async def run(stall_then: str) -> int | None:
        upstream = FakeUpstream()
        core, admission = _core(smollm2_dir, upstream)
        num_streams = rng.randint(5, 8)

        async def one(i: int) -> str:
            request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[1, 2, 3 + i]),
                                                 sampling=common_pb2.SamplingParams(max_tokens=64))
            try:
                async for _ in core.generate(request):
                    pass
            except RequestError as exc:
                return exc.status.name
            return "ok"

        tasks = [asyncio.create_task(one(i)) for i in range(num_streams)]
        async with asyncio.timeout(30):
            while len(upstream.queues) < num_streams:
                assert not any(t.done() for t in tasks), [t.result() for t in tasks if t.done()]
                await asyncio.sleep(0.001)
        queues = list(upstream.queues.values())
        index = 1
        for _ in range(rng.randint(2, 4)):  # quick steps: gaps far under the SLO
            await asyncio.sleep(rng.uniform(0.001, 0.005))
            for queue in queues:
                queue.put_nowait(_update(index))
            index += 1
        stall_s = 0.25 + rng.uniform(0, 0.1)  # 2.5 times the TBT SLO and more
        reopen_at = rng.uniform(0.1, 0.9)
        await asyncio.sleep(stall_s * reopen_at)
        if stall_then == "tokens after a reopen":  # decode died; its successor resumed the streams
            upstream.last_opened_s = time.monotonic()
        await asyncio.sleep(stall_s * (1 - reopen_at))
        for queue in queues:
            queue.put_nowait(_update(index, error="decode service died") if stall_then == "error"
                             else _update(index, prompt_step=stall_then == "prompt step"))
        if stall_then != "error":
            await asyncio.sleep(0.01)
            for queue in queues:
                queue.put_nowait(decode_pb2.TokenUpdate(first_index=index + 1,
                                                        tokens=[common_pb2.GeneratedToken(token_id=7)],
                                                        finish_reason=common_pb2.FINISH_REASON_LENGTH))
        outcomes = await asyncio.gather(*tasks)
        assert set(outcomes) == ({"UNAVAILABLE"} if stall_then == "error" else {"ok"}), outcomes
        await core.close()
        return admission.streams.limit

    assert asyncio.run(run("error")) is None  # no cap: the stall ended the streams, it was no step
    assert asyncio.run(run("tokens")) is not None  # a step that slow is a gap: the cap is cut
    assert asyncio.run(run("prompt step")) is None  # ... unless a prompt chunk made it that slow
    assert asyncio.run(run("tokens after a reopen")) is None  # ... or it spans a decode outage
