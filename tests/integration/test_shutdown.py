"""Every service stops within its shutdown deadline on SIGTERM, whatever Redis does meanwhile,
and the gpu_agent's shared memory is gone after (CI once saw an agent hang on SIGTERM, get
SIGKILLed and leave its files)."""

from __future__ import annotations

import glob
import os
import random
import re
import signal
import time
import uuid
from pathlib import Path

import pytest

from tandem.service.runtime import EXIT_SHUTDOWN_OVERDUE, SHUTDOWN_DEADLINE_S
from tests.integration.stack import Stack, fault_seed, write_tiny_chat_model

NAMES = ("router", "prefill_svc", "decode_svc", "gpu_agent")


@pytest.fixture(scope="module")
def model_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_chat_model(tmp_path_factory.mktemp("shutdown-model"), smollm2_dir)


@pytest.mark.parametrize("redis", ["answering", "hung", "gone"])
def test_sigterm_stops_every_service_in_time_and_removes_the_agents_shared_memory(
        redis: str, model_dir: Path, tmp_path: Path) -> None:
    rng = random.Random(fault_seed())
    stack = Stack(model_dir, tmp_path, num_blocks=64, extra_env={"TANDEM_CELL_ID": f"shut-{uuid.uuid4().hex[:6]}"})
    with stack:
        assert stack.redis is not None and stack.redis.pid is not None
        redis_pid = stack.redis.pid
        patterns = re.findall(r"shared memory (\S+-\*)", stack.logs("gpu_agent"))
        assert patterns and glob.glob(patterns[0])
        time.sleep(rng.uniform(0.0, 1.5))
        if redis == "hung":
            os.kill(redis_pid, signal.SIGSTOP)  # its sockets stay open and nothing answers
        elif redis == "gone":
            stack.redis.stop()
        try:
            time.sleep(rng.uniform(0.0, 2.0))  # a heartbeat or load report may be waiting on it
            start = time.monotonic()
            for name in NAMES:
                stack.procs[name].send_signal(signal.SIGTERM)
            took = {}
            for name in NAMES:
                stack.procs[name].wait(timeout=SHUTDOWN_DEADLINE_S + 7)
                took[name] = time.monotonic() - start
        finally:
            if redis == "hung":
                os.kill(redis_pid, signal.SIGCONT)
    codes = {name: stack.procs[name].returncode for name in NAMES}
    print(f"redis {redis}: exit codes {codes}, stopped after {took}")
    assert set(codes.values()) <= {0, EXIT_SHUTDOWN_OVERDUE}, {n: stack.logs(n)[-3000:] for n in NAMES}
    for name, code in codes.items():
        if code == EXIT_SHUTDOWN_OVERDUE:  # what was stuck is in its log
            assert "Stacks of every thread" in stack.logs(name)
    if codes["gpu_agent"] == EXIT_SHUTDOWN_OVERDUE:
        assert "forced to exit; removed" in stack.logs("gpu_agent")
    assert [p for pattern in patterns for p in glob.glob(pattern)] == []
