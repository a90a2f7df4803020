"""One simulated run: a workload through a policy on a configured cell, summarized with the
benchmark's own metrics so that `tandem sim` and `tandem bench` report the same numbers."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tandem.bench.metrics import RequestRecord, SloSpec, summarize
from tandem.bench.workload import RequestSpec, WorkloadSpec, build_requests
from tandem.policy.policies import Policy, get_policy
from tandem.policy.types import Predictor
from tandem.sim.config import CellConfig
from tandem.sim.simulator import SimResult, Simulator


@dataclass(frozen=True)
class RunResult:
    policy: str
    rate_rps: float | None
    records: list[RequestRecord]
    summary: dict[str, Any]
    cells: list[dict[str, Any]]
    num_events: int


def workload_requests(
    name: str,
    *,
    rate_rps: float,
    num_requests: int | None = None,
    duration_s: float | None = None,
    seed: int = 0,
    arrival: str = "poisson",
    cv: float = 1.0,
    trace_path: str | None = None,
    max_input_len: int = 8192,
    max_output_len: int = 2048,
    num_turns: int = 4,
) -> list[RequestSpec]:
    """The requests of a workload at `rate_rps`: `num_requests` of them, or as many as arrive
    in `duration_s` on average (exactly one of the two)."""
    if (num_requests is None) == (duration_s is None):
        raise ValueError("give exactly one of num_requests and duration_s")
    if num_requests is None:
        assert duration_s is not None
        num_requests = max(1, math.ceil(rate_rps * duration_s))
    spec = WorkloadSpec(name=name, num_requests=num_requests, rate_rps=rate_rps, arrival=arrival, cv=cv,
                        trace_path=trace_path, max_input_len=max_input_len, max_output_len=max_output_len,
                        num_turns=num_turns, seed=seed)
    return build_requests(spec)


def simulate(
    requests: Sequence[RequestSpec],
    *,
    policy: str | Policy,
    predictor: Predictor,
    cell_config: CellConfig,
    slo: SloSpec,
    num_cells: int = 1,
    admission: bool = True,
    rate_rps: float | None = None,
    policy_tbt_s: float | None = None,
    drop_late: bool = False,
) -> RunResult:
    """``policy``: a name (``get_policy``) or a configured policy itself, named after its class.
    ``drop_late``: FineServe's early drop, as the services' ``--drop-late`` (tandem.sim.simulator)."""
    sim = Simulator(policy=get_policy(policy) if isinstance(policy, str) else policy, predictor=predictor,
                    cell_config=cell_config, slo=slo, num_cells=num_cells, admission=admission,
                    policy_tbt_s=policy_tbt_s, drop_late=drop_late)
    result: SimResult = sim.run(requests)
    summary = summarize(result.records, duration_s=result.duration_s, slo=slo)
    name = policy if isinstance(policy, str) else type(policy).__name__
    return RunResult(name, rate_rps, result.records, summary, result.cells, result.num_events)
