"""``freeze_startup_heap``: what a service holds when it becomes ready leaves the collector's
walks, and what it allocates while serving is still collected (in a fresh interpreter, so the
test process's own heap is left alone)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import gc, json, random, sys, time
from tandem.service.runtime import freeze_startup_heap

def cycles(n):
    # A chain of lists referring both ways, unreachable once returned: only a collection frees it.
    chain = [[] for _ in range(n)]
    for a, b in zip(chain, chain[1:]):
        a.append(b)
        b.append(a)
    return n

rng = random.Random(int(sys.argv[1]))
startup = [{"k": [i, str(i)]} for i in range(rng.randint(50_000, 150_000))]  # the model, modules, ...
cycles(rng.randint(10, 1000))
before = len(gc.get_objects())
freeze_startup_heap()
after = len(gc.get_objects())
num_served = cycles(rng.randint(10, 1000))
freed = gc.collect()
print(json.dumps({"startup": len(startup), "before": before, "after": after, "frozen": gc.get_freeze_count(),
                  "served": num_served, "freed": freed, "still_there": startup[-1]["k"][0] == len(startup) - 1}))
"""


@pytest.mark.parametrize("seed", range(3))
def test_a_ready_services_heap_is_frozen_and_later_cycles_are_still_collected(seed: int) -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(seed)], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=120)
    got = json.loads(out.stdout)
    assert got["frozen"] >= got["startup"]  # the startup objects are out of the walks...
    assert got["after"] < got["before"] - got["startup"]
    assert got["still_there"]  # ...and alive
    assert got["freed"] >= got["served"]  # cycles made after the freeze are collected
