"""The router's SLO-aware admission: FineServe's rule over this router's own prefill queue.

Each request's deadline is arrival + TTFT SLO. Its TTFT is predicted from every request this
router has sent to prefill that has no first token yet, served earliest deadline first, on the
prefill units of the partition in force (read from the agent's entry on the Redis load board),
with the perf model. A request whose deadline cannot be met is refused at once with a retry hint
(HTTP 429 with ``Retry-After``, gRPC RESOURCE_EXHAUSTED with ``retry-after`` trailing metadata)
rather than queued behind work it would delay. The rule itself is the pure
``tandem.policy.admission.admit_one``; this module only keeps the queue and the partition.

One exception to the rule (in ``admit_one``): a request too long to meet the TTFT SLO even on its
own is admitted when nothing is queued ahead of it, since serving it late then delays nobody.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tandem.policy.admission import admit_one
from tandem.policy.types import Predictor, QueuedRequest, Slo
from tandem.state.schema import LoadReport

log = logging.getLogger("tandem.router.admission")

ReadAgentLoad = Callable[[], Awaitable[LoadReport | None]]


@dataclass(frozen=True)
class Refusal:
    """Why a request was refused, and when, resubmitted, it is predicted to fit."""

    reason: str
    retry_after_s: float
    predicted_ttft_s: float

    def message(self, slo: Slo) -> str:
        return (f"admission refused: {self.reason} (predicted TTFT {self.predicted_ttft_s * 1000:.0f} ms, "
                f"SLO {slo.ttft_s * 1000:.0f} ms); retry after {self.retry_after_s:.2f} s")

    @property
    def retry_after_header(self) -> str:
        """Whole seconds, as HTTP's Retry-After takes them (at least 1)."""
        return str(max(1, math.ceil(self.retry_after_s)))


class AdmissionController:
    """Keeps the requests this router sent to prefill until their first token, and decides.

    ``try_admit`` either records the request (until ``done``) and returns None, or returns a
    Refusal and records nothing. Not thread-safe; call it from the event loop. With
    ``enabled=False`` every request is admitted and only the bookkeeping is done.
    """

    def __init__(self, predictor: Predictor, slo: Slo, *, enabled: bool, default_units: int | None = None) -> None:
        self.predictor = predictor
        self.slo = slo
        self.enabled = enabled
        self._pending: dict[str, QueuedRequest] = {}
        self._default_units = default_units or len(os.sched_getaffinity(0))
        self._agent: LoadReport | None = None
        self.num_refused = 0

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def set_agent_load(self, report: LoadReport | None) -> None:
        self._agent = report

    def prefill_units(self) -> int:
        """Units prefill will run on: what it holds now, or, when it holds none because it is
        idle and lent them to decode, what the policy gives it back (all but one when decode
        is busy: decode keeps at least one)."""
        agent = self._agent
        if agent is None:
            return self._default_units
        total = len(set(agent.prefill_units) | set(agent.decode_units)) or self._default_units
        if agent.prefill_units:
            return len(agent.prefill_units)
        return max(1, total - 1) if agent.decode_units else total

    def try_admit(self, request_id: str, prompt_tokens: int, now_s: float | None = None) -> Refusal | None:
        now_s = time.monotonic() if now_s is None else now_s
        request = QueuedRequest(request_id, now_s, max(prompt_tokens, 1))
        if self.enabled:
            units = self.prefill_units()
            ahead = list(self._pending.values())
            rejection = admit_one(ahead, request, now_s, self.predictor, units, self.slo)
            if rejection is not None:
                self.num_refused += 1
                predicted_s = sum(self.predictor.predict_prefill([r.seq], units) for r in (*ahead, request))
                return Refusal(rejection.reason, rejection.retry_after_s or 0.0, predicted_s)
        self._pending[request_id] = request
        return None

    def done(self, request_id: str) -> None:
        """The request has its first token, failed or was cancelled: it no longer queues."""
        self._pending.pop(request_id, None)

    async def follow(self, read_agent_load: ReadAgentLoad, interval_s: float = 0.25) -> None:
        """Keep the partition current from the load board until cancelled."""
        while True:
            try:
                self.set_agent_load(await read_agent_load())
            except Exception as exc:  # Redis away: keep the last partition known
                log.debug("reading the agent's load failed: %s", exc)
            await asyncio.sleep(interval_s)
