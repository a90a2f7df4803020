"""`tandem bench` as a subprocess (the real CLI) against the real stack with the default model."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.engine.tokenizer import Tokenizer
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
    # Alternated: A runs the first load first, B the second.
    assert [(r["label"], r["load"], r["ran_first"]) for r in runs] == [
        ("one", "8 req/s", True), ("two", "8 req/s", False), ("two", "inf req/s", True), ("one", "inf req/s", False)]
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


def test_dataset_prompts_over_the_real_stack(stack: Stack, tmp_path: Path) -> None:
    """Real prompts from a ShareGPT-format file (cut short, as the packaged one is), other
    conversations at each load, lengths counted with the model's tokenizer."""
    sentences = ["What is the capital of France?", "Write a haiku about the sea, please.",
                 "Explain how a hash map works in two sentences.", "List three prime numbers above one hundred.",
                 "Translate 'good morning' into German and Spanish.", "Why is the sky blue? Keep it short.",
                 "Name a famous painting by Claude Monet.", "hi"]
    answers = ["Paris is the capital of France, and its largest city.", "ok"] * 4
    items = [{"id": str(k), "conversations": [{"from": "human", "value": s}, {"from": "gpt", "value": a}]}
             for k, (s, a) in enumerate(zip(sentences, answers))]
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(items)[:-40])  # the last conversation is cut off
    out = tmp_path / "dataset.json"
    _bench("--base-url", stack.http_address(), "--dataset", str(data), "--tokenizer", str(stack.model_dir),
           "--num-requests", "2", "--rate", "6", "--rate", "inf", "--max-output-len", "6", "--warmup", "0",
           "--out", str(out))
    result = json.loads(out.read_text())
    assert result["systems"]["A"]["prompt"] == "dataset text"
    tokenizer = Tokenizer.from_dir(stack.model_dir)
    # usable: both turns of at least 4 tokens, the cut-off last one gone
    usable = {len(tokenizer.encode(s, add_special_tokens=False)) for s, a in zip(sentences[:-1], answers)
              if len(tokenizer.encode(a, add_special_tokens=False)) >= 4}
    seen = []
    for run in result["runs"]:
        assert run["summary"]["num_ok"] == 2 and run["summary"]["num_failed"] == 0
        for row in run["requests"]:
            assert row["input_len"] in usable and row["output_len"] == row["max_tokens"] == 6
            seen.append(row["input_len"])
    assert len(seen) == 4
