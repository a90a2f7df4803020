"""compose.yaml describes the same stack as `tandem up`, with commands our processes accept.

No Docker engine runs on this machine, so the file is checked structurally and every service
command is parsed by the real argument parser of the process it starts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _compose(*overrides: str) -> dict:  # type: ignore[type-arg]
    """compose.yaml with ``overrides`` merged as `docker compose -f compose.yaml -f X` merges
    them: ``extends`` copies a service first; a service's mappings (environment, healthcheck)
    merge key by key, its other keys replace the base's."""
    merged = yaml.safe_load((ROOT / "compose.yaml").read_text())
    for name in overrides:
        for service, keys in yaml.safe_load((ROOT / name).read_text())["services"].items():
            base = dict(merged["services"].get(keys.get("extends", service), {}))
            for key, value in keys.items():
                if key != "extends":
                    both = isinstance(value, dict) and isinstance(base.get(key), dict)
                    base[key] = {**base[key], **value} if both else value
            merged["services"][service] = base
    return merged


def test_stack_services_and_shared_ipc() -> None:
    services = _compose()["services"]
    assert set(services) == {"redis", "gpu_agent", "prefill", "decode", "router"}
    assert services["gpu_agent"]["ipc"] == "shareable"
    for name in ("prefill", "decode"):
        assert services[name]["ipc"] == "service:gpu_agent"  # same /dev/shm: one copy of weights and KV
    for name in ("gpu_agent", "prefill", "decode", "router"):
        assert services[name]["environment"]["REDIS_URL"] == "redis://redis:6379/0"
    assert "50051:50051" in services["router"]["ports"]


@pytest.mark.parametrize("overrides", [(), ("compose.multimodel.yaml",)])
def test_every_command_parses_with_its_process_flags(smollm2_dir: Path, overrides: tuple[str, ...],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from decode_svc.config import parse_args as decode_args
    from gpu_agent.config import parse_args as agent_args
    from prefill_svc.config import parse_args as prefill_args
    from router.config import parse_args as router_args

    parsers: dict[str, Callable[[list[str]], Any]] = {"gpu_agent": agent_args, "prefill_svc": prefill_args, "decode_svc": decode_args, "router": router_args}
    services = _compose(*overrides)["services"]
    seen = set()
    for name, service in services.items():
        command = service.get("command", [])
        if command[:2] != ["python", "-m"]:
            continue
        module, args = command[2], command[3:]
        for key, value in service["environment"].items():
            monkeypatch.setenv(key, str(value))
        config = parsers[module](args)
        seen.add(module)
        assert getattr(config, "port", None) or getattr(config, "grpc_port", None)
        if module in ("prefill_svc", "decode_svc"):  # others reach it at its service name
            assert config.announced_address == f"{name}:{config.port}", name
            assert service["ipc"] == "service:gpu_agent", name
    assert seen == set(parsers)


@pytest.mark.parametrize("overrides", [(), ("compose.multimodel.yaml",)])
def test_every_tandem_service_has_a_healthcheck_on_its_own_port(smollm2_dir: Path, overrides: tuple[str, ...],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """`docker compose up --wait` and `docker compose ps` read these: each probes the gRPC port
    its own process serves (the router's readiness for the router), with the shared timings."""
    import argparse

    from decode_svc.config import parse_args as decode_args
    from gpu_agent.config import parse_args as agent_args
    from prefill_svc.config import parse_args as prefill_args
    from router.config import parse_args as router_args
    from tandem import health_cli

    parsers: dict[str, Callable[[list[str]], Any]] = {"gpu_agent": agent_args, "prefill_svc": prefill_args, "decode_svc": decode_args, "router": router_args}
    probe = argparse.ArgumentParser()
    health_cli._arguments(probe)
    services = _compose(*overrides)["services"]
    checked = 0
    for name, service in services.items():
        command = service.get("command", [])
        if command[:2] != ["python", "-m"]:
            continue
        for key, value in service["environment"].items():
            monkeypatch.setenv(key, str(value))
        config = parsers[command[2]](command[3:])
        check = service["healthcheck"]
        assert check["test"][:4] == ["CMD", "python", "-m", "tandem.health_cli"], name
        args = probe.parse_args(check["test"][4:])
        port = config.grpc_port if command[2] == "router" else config.port
        assert args.address == f"127.0.0.1:{port}", name
        assert args.ready == (command[2] == "router"), name
        assert {"interval", "timeout", "retries", "start_period"} <= set(check), name
        checked += 1
    assert checked == len(services) - 1  # all but Redis, which has its own


def test_the_two_model_cell_runs_a_decode_and_a_prefill_per_model_behind_one_router(
        smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from decode_svc.config import parse_args as decode_args
    from gpu_agent.config import parse_args as agent_args
    from router.config import parse_args as router_args

    services = _compose("compose.multimodel.yaml")["services"]
    monkeypatch.setenv("REDIS_URL", services["router"]["environment"]["REDIS_URL"])
    agent = agent_args(services["gpu_agent"]["command"][3:])
    names = [spec.served_name(smollm2_dir) for spec in agent.models]
    decode_models = sorted(decode_args(s["command"][3:]).model for n, s in services.items() if n.startswith("decode"))
    assert decode_models == sorted(names) and len(set(names)) == 2
    router = router_args(services["router"]["command"][3:])
    assert [name for name, _ in router.served_models] == names and not router.static_upstreams


def test_dockerfile_bakes_the_default_model() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "tandem models pull-default" in text
    assert 'torch==2.13.0' in text
