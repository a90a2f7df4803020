"""Admission's calibration across a restart, on the real stack: a router that measured prefill
writes its calibration to ``--admission-cache`` (through its TANDEM_* twin, as ``tandem up``
passes it) when it stops, and the next router given that directory reads it back and starts
calibrated, the same factor, before its first request."""

from __future__ import annotations

import asyncio
import json
import random
import re
import uuid
from pathlib import Path

import pytest

from tandem.engine.sampling import SamplingParams
from tests.integration.mesh_client import generate
from tests.integration.stack import Stack

pytestmark = pytest.mark.slow


def test_a_restarted_router_starts_from_the_calibration_it_measured(smollm2_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "admission-cache"
    env = {"TANDEM_ADMISSION_CACHE": str(cache), "TANDEM_CELL_ID": f"cache-{uuid.uuid4().hex[:6]}"}
    rng = random.Random()
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for logs in ("first", "second"):
        (tmp_path / logs).mkdir()
    with Stack(smollm2_dir, tmp_path / "first", num_blocks=256, admission="on", extra_env=env) as stack:
        async def measure() -> None:
            # One at a time: each prompt's first token is one measured batch (the first warms up).
            for _ in range(rng.randint(3, 6)):
                await generate(stack.address("router"), [rng.randrange(100, 40000) for _ in range(rng.randint(8, 200))],
                               params)

        asyncio.run(measure())
    files = list(cache.glob("*.json"))
    assert len(files) == 1, files
    saved = json.loads(files[0].read_text())
    assert saved["version"] == 1 and saved["all"]["num_samples"] >= 2, saved
    with Stack(smollm2_dir, tmp_path / "second", num_blocks=256, admission="on", extra_env=env) as stack:
        log = stack.logs("router")
    found = re.search(r"admission: calibration read from (\S+): x([0-9.]+) over all", log)
    assert found is not None, log[-3000:]
    assert Path(found.group(1)) == files[0]
    assert float(found.group(2)) == pytest.approx(saved["all"]["factor"], abs=0.006)  # logged to 2 decimals
