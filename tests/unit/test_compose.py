"""compose.yaml describes the same stack as `tandem up`, with commands our processes accept.

No Docker engine runs on this machine, so the file is checked structurally and every service
command is parsed by the real argument parser of the process it starts.
"""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _compose() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_stack_services_and_shared_ipc() -> None:
    services = _compose()["services"]
    assert set(services) == {"redis", "gpu_agent", "prefill", "decode", "router"}
    assert services["gpu_agent"]["ipc"] == "shareable"
    for name in ("prefill", "decode"):
        assert services[name]["ipc"] == "service:gpu_agent"  # same /dev/shm: one copy of weights and KV
    for name in ("gpu_agent", "prefill", "decode", "router"):
        assert services[name]["environment"]["REDIS_URL"] == "redis://redis:6379/0"
    assert "50051:50051" in services["router"]["ports"]


def test_every_command_parses_with_its_process_flags(smollm2_dir: Path) -> None:
    from decode_svc.config import parse_args as decode_args
    from gpu_agent.config import parse_args as agent_args
    from prefill_svc.config import parse_args as prefill_args
    from router.config import parse_args as router_args

    parsers = {"gpu_agent": agent_args, "prefill_svc": prefill_args, "decode_svc": decode_args, "router": router_args}
    services = _compose()["services"]
    seen = set()
    for name, service in services.items():
        command = service.get("command", [])
        if command[:2] != ["python", "-m"]:
            continue
        module, args = command[2], command[3:]
        config = parsers[module](args)
        seen.add(module)
        assert getattr(config, "port", None) or getattr(config, "grpc_port", None)
    assert seen == set(parsers)


def test_dockerfile_bakes_the_default_model() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "tandem models pull-default" in text
    assert 'torch==2.13.0' in text
