"""`tandem bench` as a subprocess (the real CLI) against the real stack with the default model."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.stack import ROOT, Stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with Stack(smollm2_dir, tmp_path_factory.mktemp("bench-logs"), num_blocks=512,
               extra_env={"TANDEM_CELL_ID": f"bench-{uuid.uuid4().hex[:6]}"}) as s:
        yield s


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "tandem.cli", "bench", "--no-progress", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_ab_sweep_over_the_real_stack(stack: Stack, tmp_path: Path) -> None:
    url = stack.http_address()
    out, plots = tmp_path / "result.json", tmp_path / "plots"
    done = _bench("--base-url", url, "--base-url-b", url, "--label-a", "one", "--label-b", "two",
                  "--workload", "fixed", "--input-len", "24", "--output-len", "6", "--num-requests", "3",
                  "--rate", "8", "--rate", "inf", "--seed", "3", "--out", str(out), "--plots", str(plots))
    result = json.loads(out.read_text())
    assert result["systems"]["one"]["is_tandem"] and result["systems"]["one"]["prompt"] == "token_ids"
    runs = result["runs"]
    assert [(r["label"], r["load"]) for r in runs] == [("one", "8 req/s"), ("two", "8 req/s"),
                                                       ("one", "inf req/s"), ("two", "inf req/s")]
    for run in runs:
        assert run["summary"]["num_ok"] == 3 and run["summary"]["num_failed"] == 0
        for row in run["requests"]:
            assert row["error"] is None, row
            assert row["output_len"] == row["max_tokens"] == 6
            assert row["input_len"] == 24
            assert 0 < row["ttft_s"] <= row["e2e_s"]
            times = row["token_times_s"]
            assert times == sorted(times) and times[0] >= row["arrival_s"] and row["finish_s"] >= times[-1]
        assert run["summary"]["ttft_s"]["mean"] > 0 and run["summary"]["output_token_throughput"] > 0
    # The same seed gives both systems the same schedule.
    assert [r["scheduled_s"] for r in runs[0]["requests"]] == [r["scheduled_s"] for r in runs[1]["requests"]]
    assert len(result["ratios_b_over_a"]) == 2 and result["ratios_b_over_a"][0]["ttft_mean"] > 0
    assert "two/one at 8 req/s: goodput" in done.stdout and "TTFT mean" in done.stdout
    for name in ("cdf_8req_s.png", "cdf_infreq_s.png", "goodput_vs_rate.png"):
        assert (plots / name).stat().st_size > 1000, name


def test_chat_endpoint_with_fixed_concurrency(stack: Stack, tmp_path: Path) -> None:
    out = tmp_path / "chat.json"
    _bench("--base-url", stack.http_address(), "--endpoint", "chat", "--workload", "fixed", "--input-len", "12",
           "--output-len", "5", "--num-requests", "3", "--concurrency", "2", "--warmup", "0", "--out", str(out))
    run, = json.loads(out.read_text())["runs"]
    assert run["load"] == "c=2" and run["summary"]["num_ok"] == 3
    assert all(row["output_len"] == 5 and row["error"] is None for row in run["requests"])
