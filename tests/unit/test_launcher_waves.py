"""``tandem up`` starts a stack in waves: every cell's agent, then all prefill and decode services
at once, then the router. Real processes (``tests.unit.wave_child``: a gRPC server that starts
after a random delay), random delays, one wave member that dies in some runs."""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from tandem.launcher import CellProcs, Child, RestartBudget, Supervisor
from tandem.service.runtime import free_port

ROOT = Path(__file__).resolve().parents[2]


def _child(name: str, log: Path, delay_s: float, needs: list[Child], code: int = 0) -> Child:
    port = free_port()
    argv = ["tests.unit.wave_child", name, str(port), str(log), f"{delay_s:.3f}", str(code),
            *(c.address.rsplit(":", 1)[1] for c in needs)]
    return Child(name, lambda: argv, f"127.0.0.1:{port}", {"PYTHONPATH": str(ROOT)}, RestartBudget(3, 60.0))


def _supervisor(cells: list[CellProcs], router: Child) -> Supervisor:
    sup = Supervisor.__new__(Supervisor)  # the start-up logic alone: no args, plans or Redis
    sup.args = argparse.Namespace(ready_timeout_s=60.0)
    sup.stopping = False
    sup.cells = cells
    sup.router = router
    sup.children = [*(c for cell in cells for c in cell.children), router]
    return sup


def _events(log: Path) -> list[tuple[float, str, str, str]]:
    rows = [line.split(" ") + [""] for line in log.read_text().splitlines()]
    return sorted((float(r[0]), r[1], r[2], r[3]) for r in rows)


@pytest.mark.parametrize("seed", range(3))
def test_agents_then_every_worker_at_once_then_the_router(seed: int, tmp_path: Path) -> None:
    rng = random.Random(seed)
    log = tmp_path / "events"
    cells = []
    for i in range(rng.randint(1, 2)):
        agent = _child(f"agent{i}", log, rng.uniform(0, 0.4), [])
        cell = CellProcs(SimpleNamespace(cell_id=f"c{i}"), agent.address, agent)  # type: ignore[arg-type]
        cell.workers = [_child(f"{role}{i}", log, rng.uniform(0.2, 0.8), [agent]) for role in ("decode", "prefill")]
        cells.append(cell)
    workers = [w for cell in cells for w in cell.workers]
    router = _child("router", log, 0.0, workers)
    sup = _supervisor(cells, router)
    try:
        sup.start(sup.children)
        events = _events(log)
        starts = {name: (t, up) for t, what, name, up in events if what == "start"}
        readies = {name: t for t, what, name, _ in events if what == "ready"}
        assert set(readies) == {c.name for c in sup.children}
        agents_ready = max(readies[cell.agent.name] for cell in cells if cell.agent is not None)
        for cell in cells:
            for w in cell.workers:  # after the agents, each found its agent serving
                assert starts[w.name][0] > agents_ready
                assert starts[w.name][1] == cell.agent_address.rsplit(":", 1)[1]
        # all workers started before the first of them served: together, not one by one
        assert max(starts[w.name][0] for w in workers) < min(readies[w.name] for w in workers)
        assert starts["router"][0] > max(readies[w.name] for w in workers)
        assert len(starts["router"][1].split(",")) == len(workers)
    finally:
        for child in sup.children:
            child.stop(5)


def test_a_worker_that_dies_fails_the_start_after_its_wave_and_the_router_never_starts(tmp_path: Path) -> None:
    log = tmp_path / "events"
    agent = _child("agent", log, 0.0, [])
    cell = CellProcs(SimpleNamespace(cell_id="c"), agent.address, agent)  # type: ignore[arg-type]
    dying = _child("decode", log, 0.1, [agent], code=5)
    healthy = _child("prefill", log, 0.6, [agent])
    cell.workers = [dying, healthy]
    router = _child("router", log, 0.0, [])
    sup = _supervisor([cell], router)
    try:
        with pytest.raises(RuntimeError, match="decode exited with code 5"):
            sup.start(sup.children)
        names = {(what, name) for _, what, name, _ in _events(log)}
        assert ("ready", "prefill") in names  # its wave mate was waited for, and left serving
        assert healthy.alive() and not dying.alive()
        assert not any(name == "router" for _, name in names)
    finally:
        for child in sup.children:
            child.stop(5)
