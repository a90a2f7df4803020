"""The router's counters of the services' drops and preemptions, folded from the load board's
cumulative counts: each scrape adds what grew since the service's last entry was read; a
restarted service is a new process with a new id and counts from zero; a count that goes down
under one id (it cannot, short of a bug) is taken as counting from zero, never subtracted."""

from __future__ import annotations

import itertools
import random

from router.metrics import RouterMetrics
from tandem.protocol import LoadReport, Role


def report(service_id: str, role: Role, dropped: int, preempted: int) -> LoadReport:
    return LoadReport(service_id=service_id, cell_id="c", role=role, num_queued_requests=0, num_queued_tokens=0,
                      num_running=0, batch_size=0, predicted_ttft_ms=0, last_step_ms=0, partition_epoch=1,
                      prefill_units=[0], decode_units=[1], kv_free_blocks=0, kv_total_blocks=1, updated_unix_ns=1,
                      num_dropped=dropped, num_preemptions=preempted)


def value(metrics: RouterMetrics, name: str) -> float:
    got = metrics.registry.get_sample_value(name)
    assert got is not None, name
    return got


def test_counts_grow_by_what_each_service_added_across_restarts_and_missed_scrapes() -> None:
    rng = random.Random(7)
    for _ in range(50):
        metrics = RouterMetrics()
        ids = itertools.count()
        want = {"prefill": [0, 0], "decode": [0, 0]}
        live: dict[str, tuple[Role, list[int]]] = {"p0": ("prefill", [0, 0]), "d0": ("decode", [0, 0])}
        for step in range(rng.randint(1, 30)):
            for sid, (role, counts) in list(live.items()):
                grow = [rng.randint(0, 3) if role == "prefill" else 0, rng.randint(0, 3)]
                counts[0] += grow[0]
                counts[1] += grow[1]
                want[role][0] += grow[0]
                want[role][1] += grow[1]
                if rng.random() < 0.1:  # it stops after one last scrape; its successor counts from zero
                    metrics.count_services([report(sid, role, *counts)])
                    del live[sid]
                    live[f"{role[0]}{next(ids) + 1}"] = (role, [0, 0])
            # An entry may be missing from a scrape (board TTL); it shows its growth at the next.
            metrics.count_services([report(sid, role, *c) for sid, (role, c) in live.items() if rng.random() < 0.8])
        metrics.count_services([report(sid, role, *c) for sid, (role, c) in live.items()])
        assert value(metrics, "tandem:num_requests_dropped_total") == want["prefill"][0]
        assert value(metrics, "tandem:num_prefill_pauses_total") == want["prefill"][1]
        assert value(metrics, "tandem:num_preemptions_total") == want["decode"][1]


def test_a_count_that_goes_down_under_one_id_counts_from_zero() -> None:
    metrics = RouterMetrics()
    metrics.count_services([report("p", "prefill", 5, 0)])
    metrics.count_services([report("p", "prefill", 2, 0)])
    assert value(metrics, "tandem:num_requests_dropped_total") == 7
