"""Router admission by predicted TTFT on the real stack (real SmolLM2, real processes).

The router predicts each request's TTFT from the requests it has in prefill, batched as prefill
batches them, and the perf model on the prefill cores of the partition in force, calibrated
online from the measured batches. With a 600 ms TTFT SLO a burst of short prompts cannot all be
served in time on this CPU: the first few are admitted, the rest are refused at once with 429 /
RESOURCE_EXHAUSTED and a retry hint, and every KV block comes back. With the default 2 s SLO
and no profile, a burst of 16 short chats, which prefill serves in two batches well within it,
is admitted whole, before and after the online calibration. With a 20 ms TBT SLO, streams that
arrive while a dozen run are refused over the stream cap, which is gone once the cell is idle.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.client import AsyncTandemClient, Overloaded
from tandem.policy.admission import DEFAULT_COLD_MARGIN
from tests.e2e.test_openai_api import _wait_all_blocks_free
from tests.integration.stack import Stack

pytestmark = pytest.mark.slow

TTFT_SLO_MS = 600
BURST = 16
# About 28 tokens: ~2 ms a token of prefill on both cores (the perf model, uncalibrated, agrees
# within ~10 % on this CPU), so the last of 32 needs ~2 s, over the uncalibrated model's refusal
# threshold (2 x the SLO) even on a machine twice as fast as predicted.
HTTP_BURST = 32
STORY = "tell me a short story about a cat who lives in a lighthouse by the sea and keeps the lamp"


@pytest.fixture(scope="module")
def stack(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with Stack(smollm2_dir, tmp_path_factory.mktemp("admission-logs"), num_blocks=512, admission="on",
               extra_env={"TANDEM_TTFT_SLO_MS": str(TTFT_SLO_MS), "TANDEM_CELL_ID": f"adm-{uuid.uuid4().hex[:6]}"}) as s:
        yield s


def _admission_sample(page: str, name: str, **labels: str) -> float:
    """The one sample of ``tandem:admission_<name>`` with ``labels`` on a /metrics page."""
    found = [sample.value for family in text_string_to_metric_families(page) for sample in family.samples
             if sample.name == f"tandem:admission_{name}" and all(sample.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_http_burst_is_partly_refused_with_retry_after_and_blocks_come_back(stack: Stack) -> None:
    base = stack.http_address()

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as http:
            bodies = [{"model": "default", "prompt": f"Request {i}: {STORY}, please.",
                       "max_tokens": 4, "ignore_eos": True} for i in range(HTTP_BURST)]
            return list(await asyncio.gather(*(http.post(f"{base}/v1/completions", json=b) for b in bodies)))

    responses = asyncio.run(run())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, [r.text for r in responses if r.status_code not in (200, 429)]
    assert codes.count(200) >= 1, "admission refused even the first request of an idle cell"
    assert codes.count(429) >= 1, f"a {HTTP_BURST}-request burst cannot meet a 600 ms TTFT on this CPU, yet none was refused"
    for r in responses:
        if r.status_code == 429:
            error = r.json()["error"]
            assert "admission refused" in error["message"] and "TTFT" in error["message"], error
            assert error["code"] == "rate_limit_exceeded"
            assert 1 <= int(r.headers["retry-after-ms"]) <= 1000 * int(r.headers["retry-after"])
        else:
            assert r.json()["usage"]["completion_tokens"] == 4
    stats = asyncio.run(_wait_all_blocks_free(stack, 30))
    assert stats.num_free_blocks == stats.num_blocks and stats.num_requests == 0
    # /metrics counts them (the module's first requests): refused for their TTFT, the rest admitted
    page = stack.metrics()
    assert _admission_sample(page, "refused_total", reason="ttft") == codes.count(429)
    assert _admission_sample(page, "refused_total", reason="tbt") == 0
    assert _admission_sample(page, "admitted_total") >= codes.count(200)
    assert _admission_sample(page, "prefill_calibration") > 0


def test_lone_long_prompt_on_an_idle_cell_is_served(stack: Stack) -> None:
    """Too long for the SLO on its own, but nothing is queued ahead: serving it late delays nobody."""
    with httpx.Client(timeout=120) as http:
        r = http.post(f"{stack.http_address()}/v1/completions",
                      json={"model": "default", "prompt": "hello " * 600, "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text


def test_grpc_refusal_carries_the_retry_hint(stack: Stack) -> None:
    async def run() -> list[BaseException | None]:
        async with AsyncTandemClient(stack.address("router"), max_retries=0, max_refusal_retries=0,
                                     timeout_s=120) as client:
            async def one(i: int) -> BaseException | None:
                try:
                    # prompts of ~360 tokens: by now admission is calibrated to the real prefill
                    # speed, and 16 of these (several batches, seconds) cannot all fit 600 ms
                    await client.generate(f"Request {i}: {' and '.join([STORY] * 8)}, please.", max_tokens=2)
                except Overloaded as exc:
                    return exc
                return None

            return list(await asyncio.gather(*(one(i) for i in range(BURST))))

    outcomes = asyncio.run(run())
    refused = [o for o in outcomes if isinstance(o, Overloaded)]
    assert refused and len(refused) < BURST
    for exc in refused:
        assert exc.retry_after_s is not None and exc.retry_after_s >= 0
        assert "admission refused" in str(exc)


def test_a_retry_of_a_refused_request_keeps_the_deadline_of_its_first_send(stack: Stack) -> None:
    """A burst, each request sent once more after the burst as the openai client retries a 429
    (the same body, ``x-stainless-retry-count: 1``), the cell idle by then: a refused request's
    retry is refused again, its first send's deadline being past; the same body sent as a new
    request (count 0, or no header) is served, and so is the retry of one that was served."""
    base = stack.http_address()
    bodies = [{"model": "default", "prompt": f"Retry {uuid.uuid4().hex[:6]} {i}: {STORY}, please.",
               "max_tokens": 2, "ignore_eos": True} for i in range(HTTP_BURST)]

    async def send(http: httpx.AsyncClient, body: dict[str, object], count: str | None) -> httpx.Response:
        headers = {"x-stainless-retry-count": count} if count is not None else {}
        return await http.post(f"{base}/v1/completions", json=body, headers=headers)

    async def run() -> tuple[list[httpx.Response], list[tuple[int, httpx.Response, httpx.Response, httpx.Response]]]:
        async with httpx.AsyncClient(timeout=120) as http:
            first = list(await asyncio.gather(*(send(http, b, "0") for b in bodies)))
            # Every first send's deadline is past by more than any margin admission allows (the
            # cold margin, 1x the SLO, at most): a retry sooner may still be admitted, and rightly.
            await asyncio.sleep((2 + DEFAULT_COLD_MARGIN) * TTFT_SLO_MS / 1000)
            # One at a time, each to an idle cell; every retry first, so that all come well within
            # the router's memory of refusals (30 s), however slow the sends that serve.
            retries = [await send(http, body, "1") for body in bodies]
            again = [(i, retry, await send(http, bodies[i], "0"), await send(http, bodies[i], None))
                     for i, retry in enumerate(retries)]
            return first, again

    first, again = asyncio.run(run())
    refused = {i for i, r in enumerate(first) if r.status_code == 429}
    assert refused and len(refused) < len(first), [r.status_code for r in first]
    for i, retry, new, bare in again:
        if i in refused:
            assert retry.status_code == 429 and "deadline already passed" in retry.json()["error"]["message"], retry.text
        else:
            assert retry.status_code == 200, retry.text  # nothing refused: a retry header alone changes nothing
        assert new.status_code == 200 and bare.status_code == 200, (new.text, bare.text)
    stats = asyncio.run(_wait_all_blocks_free(stack, 30))
    assert stats.num_free_blocks == stats.num_blocks and stats.num_requests == 0


def test_a_grpc_resend_of_a_refused_request_keeps_the_deadline_of_its_first_send(stack: Stack) -> None:
    """The gRPC side of the test above: a burst through the SDK with its refusal retries off,
    then each request sent again as the SDK resends a refusal (``tandem-retry-count: 1``) once the
    first sends' deadlines are past: a refused one is refused again ("deadline already passed"),
    the same request sent as a new one is served, and so is the resend of one that was served.
    Then a burst with the SDK's own refusal retries: every call completes or raises Overloaded,
    and every KV block comes back."""
    prompts = [f"Resend {uuid.uuid4().hex[:6]} {i}: {STORY}, please." for i in range(HTTP_BURST)]

    async def send(prompt: str, count: str | None, retries: int = 0) -> BaseException | None:
        metadata = {"tandem-retry-count": count} if count is not None else {}
        async with AsyncTandemClient(stack.address("router"), max_retries=0, max_refusal_retries=retries,
                                     metadata=metadata, timeout_s=120) as client:
            try:
                completion = await client.generate(prompt, max_tokens=2, ignore_eos=True)
            except Overloaded as exc:
                return exc
            assert completion.usage is not None and completion.usage.completion_tokens == 2
            return None

    async def run() -> tuple[list[BaseException | None], list[tuple[int, BaseException | None, BaseException | None]],
                             list[BaseException | None]]:
        first = list(await asyncio.gather(*(send(p, None) for p in prompts)))
        await asyncio.sleep((2 + DEFAULT_COLD_MARGIN) * TTFT_SLO_MS / 1000)
        resent = [await send(p, "1") for p in prompts]
        again = [(i, retry, await send(prompts[i], None)) for i, retry in enumerate(resent)]
        retried = list(await asyncio.gather(*(send(f"{p} Again.", None, retries=2) for p in prompts)))
        return first, again, retried

    first, again, retried = asyncio.run(run())
    refused = {i for i, o in enumerate(first) if isinstance(o, Overloaded)}
    assert refused and len(refused) < len(first)
    for i, retry, new in again:
        if i in refused:
            assert isinstance(retry, Overloaded) and "deadline already passed" in str(retry), retry
        else:
            assert retry is None, retry
        assert new is None, new
    assert all(o is None or isinstance(o, Overloaded) for o in retried) and any(o is None for o in retried)
    stats = asyncio.run(_wait_all_blocks_free(stack, 30))
    assert stats.num_free_blocks == stats.num_blocks and stats.num_requests == 0


CHAT_BURST = 16
DEFAULT_TTFT_SLO_S = 2.0


@pytest.fixture(scope="module")
def default_stack(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The default stack: admission on, the default 2 s TTFT SLO, no profile."""
    with Stack(smollm2_dir, tmp_path_factory.mktemp("admission-default-logs"), num_blocks=512, admission="on",
               extra_env={"TANDEM_CELL_ID": f"adm-{uuid.uuid4().hex[:6]}"}) as s:
        yield s


async def _chat_burst(base: str, round_: int) -> list[tuple[int, float, str]]:
    """(status, seconds to the first streamed chunk, error text) of each chat of one burst."""
    async with httpx.AsyncClient(timeout=120) as http:
        async def one(i: int) -> tuple[int, float, str]:
            body = {"model": "default", "max_tokens": 8, "ignore_eos": True, "stream": True,
                    "messages": [{"role": "user", "content": f"Round {round_}, question {i}: name a colour."}]}
            started_s = time.perf_counter()
            async with http.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    return r.status_code, 0.0, (await r.aread()).decode()
                ttft_s = 0.0
                async for line in r.aiter_lines():
                    if line.startswith("data:") and not ttft_s:
                        ttft_s = time.perf_counter() - started_s
                return r.status_code, ttft_s, ""

        return list(await asyncio.gather(*(one(i) for i in range(CHAT_BURST))))


def test_burst_of_short_chats_that_fits_the_slo_is_admitted_whole(default_stack: Stack) -> None:
    """Issue 10: 16 concurrent ~40-token chats were mostly refused, predicted one prefill after
    another by an uncalibrated model, though prefill serves them in two batches within 2 s.

    The first burst is judged by the uncalibrated model; its batches calibrate it. The second
    is judged by the calibrated model, and must be admitted whole whenever the first one really
    met the SLO (on a machine too busy for that, refusing is right, and only the first counts).
    """
    base = default_stack.http_address()
    # A lone request first: it is always admitted, and takes the fresh prefill's one-time costs
    # (its batch is admission's warm-up, not used to calibrate).
    with httpx.Client(timeout=120) as http:
        r = http.post(f"{base}/v1/chat/completions", json={
            "model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "Hello!"}]})
    assert r.status_code == 200, r.text
    outcomes = asyncio.run(_chat_burst(base, 0))
    refused = [text for status, _, text in outcomes if status != 200]
    assert not refused, f"uncalibrated: {len(refused)} of {CHAT_BURST} refused: {refused[:2]}"
    default_stack.wait_log("router", "admission calibrated", 10)
    slowest_s = max(ttft_s for _, ttft_s, _ in outcomes)
    outcomes = asyncio.run(_chat_burst(base, 1))
    refused = [text for status, _, text in outcomes if status != 200]
    if slowest_s > DEFAULT_TTFT_SLO_S:
        pytest.skip(f"the machine is too busy for this burst to fit the SLO (first burst's slowest TTFT "
                    f"{slowest_s:.2f} s); the calibrated round refused {len(refused)}")
    assert not refused, (f"calibrated: {len(refused)} of {CHAT_BURST} refused although the first burst's slowest "
                         f"TTFT was {slowest_s:.2f} s: {refused[:2]}\n" + default_stack.logs("router")[-3000:])


@pytest.fixture(scope="module")
def tight_tbt_stack(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A 20 ms TBT SLO: no step of a dozen streams makes it on this CPU, so the stream cap engages."""
    with Stack(smollm2_dir, tmp_path_factory.mktemp("admission-tbt-logs"), num_blocks=512, admission="on",
               extra_env={"TANDEM_TBT_SLO_MS": "20", "TANDEM_CELL_ID": f"adm-{uuid.uuid4().hex[:6]}"}) as s:
        yield s


def test_streams_over_the_tbt_cap_are_refused_and_an_idle_cell_admits_again(tight_tbt_stack: Stack) -> None:
    """Twelve long streams overload decode against its TBT SLO; the router learns a cap from their
    token gaps and refuses what arrives while they run, with the TBT reason and a retry hint. Every
    block comes back, and once nothing is in flight the cap is gone."""
    base = tight_tbt_stack.http_address()

    async def run() -> tuple[list[int], list[httpx.Response]]:
        async with httpx.AsyncClient(timeout=300) as http:
            started = asyncio.Event()
            first_tokens = 0

            async def stream(i: int) -> int:
                nonlocal first_tokens
                body = {"model": "default", "max_tokens": 160, "ignore_eos": True, "stream": True,
                        "messages": [{"role": "user", "content": f"Stream {i}: count slowly."}]}
                async with http.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
                    counted = False
                    async for line in r.aiter_lines():
                        if line.startswith("data:") and not counted:
                            counted, first_tokens = True, first_tokens + 1
                            if first_tokens == 12:
                                started.set()
                    return r.status_code

            streams = [asyncio.create_task(stream(i)) for i in range(12)]
            await asyncio.wait_for(started.wait(), 120)
            await asyncio.sleep(2.0)  # a few hundred gaps, each far over 20 ms
            late = [await http.post(f"{base}/v1/chat/completions", json={
                "model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": f"Late {i}."}]})
                for i in range(4)]
            nonlocal page
            page = (await http.get(f"{base}/metrics")).text  # while the streams still run
            return list(await asyncio.gather(*streams)), late

    page = ""
    codes, late = asyncio.run(run())
    assert codes == [200] * 12
    refused = [r for r in late if r.status_code == 429]
    assert refused, [r.text for r in late]
    for r in refused:
        message = r.json()["error"]["message"]
        assert "decode is at the most streams that keep the TBT SLO" in message, message
        assert 1 <= int(r.headers["retry-after-ms"]) <= 1000 * int(r.headers["retry-after"])
    # /metrics saw the cap while the streams ran, and counted the refusals over it
    assert _admission_sample(page, "refused_total", reason="tbt") == len(refused)
    assert 1 <= _admission_sample(page, "stream_cap") <= 12
    stats = asyncio.run(_wait_all_blocks_free(tight_tbt_stack, 60))
    assert stats.num_free_blocks == stats.num_blocks and stats.num_requests == 0
    with httpx.Client(timeout=120) as http:  # idle: the cap is released
        r = http.post(f"{base}/v1/chat/completions", json={
            "model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "Hello again."}]})
    assert r.status_code == 200, r.text
