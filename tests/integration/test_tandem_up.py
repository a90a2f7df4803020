"""`tandem up` brings the whole stack up as separate processes and SIGTERM takes it all down."""

from __future__ import annotations

import json
import re
import urllib.request
import uuid
from pathlib import Path

import grpc

from tandem.rpc.v1 import common_pb2, router_pb2, router_pb2_grpc
from tandem.service.runtime import free_ports
from tests.integration.stack import start_up, stop_up, write_tiny_chat_model


def test_up_serves_and_sigterm_stops_everything(smollm2_dir: Path, tmp_path: Path) -> None:
    model_dir = write_tiny_chat_model(tmp_path / "model", smollm2_dir)
    port, http_port = free_ports(2)
    cell = f"up-{uuid.uuid4().hex[:6]}"
    log_path = tmp_path / "up.log"
    decisions, steps = tmp_path / "decisions.jsonl", tmp_path / "steps.jsonl"
    proc = start_up(["--model", str(model_dir), "--grpc-port", str(port), "--port", str(http_port), "--cell-id",
                     cell, "--kv-cache-gb", "0.05", "--admission-log", str(decisions), "--step-log", str(steps)],
                    log_path, timeout_s=180)  # with a Redis of its own
    try:
        text = log_path.read_text(errors="replace")
        pids = [int(p) for p in re.findall(r"ready at \S+ \(pid (\d+)\)", text)]
        assert len(set(pids)) == 4  # agent, decode, prefill, router: four processes
        assert "redis at redis://127.0.0.1:" in text
        assert f"HTTP at http://127.0.0.1:{http_port}" in text and f"gRPC at 127.0.0.1:{port}" in text
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=10) as answer:
            assert answer.status == 200

        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            request = router_pb2.GenerateRequest(
                text="Hello", sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            )
            responses = list(router_pb2_grpc.RouterStub(channel).Generate(request, timeout=60))
        assert sum(len(r.tokens) for r in responses) == 4
        assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        # --admission-log reached the router: the request's decision and its first token
        events = [json.loads(line) for line in decisions.read_text().splitlines()]
        admitted = [e for e in events if e["event"] == "admitted"]
        assert len(admitted) == 1 and any(e["request_id"] == admitted[0]["request_id"] for e in events[1:])
        # --step-log reached decode: its steps computed the 4 tokens (the first is prefill's, or
        # a hybrid step's), each line naming the service
        rows = [json.loads(line) for line in steps.read_text().splitlines()]
        assert rows and all(r["service_id"].startswith("decode") for r in rows)
        assert sum(r["num_seqs"] * r["steps"] for r in rows) >= 3

        stop_up(proc, log_path, timeout_s=60)
        assert "tandem up: stopped" in log_path.read_text(errors="replace")
        for pid in pids:
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
        assert not list(Path("/dev/shm").glob(f"tandem-{cell}-*"))  # weights and KV pool unlinked
    finally:
        if proc.poll() is None:
            proc.kill()
