"""Every process's config declares each flag once, on its field: flag, TANDEM_* twin, default, help."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from decode_svc.config import DecodeConfig
from decode_svc.config import parse_args as parse_decode
from gpu_agent.config import AgentConfig
from gpu_agent.config import parse_args as parse_agent
from tandem.service.model_spec import ModelSpec
from prefill_svc.config import PrefillConfig
from prefill_svc.config import parse_args as parse_prefill
from router.config import RouterConfig, parse_args
from tandem.service.flags import env_name, flag_specs

PARSERS: list[tuple[type, Callable[[Sequence[str]], Any]]] = [
    (RouterConfig, parse_args), (PrefillConfig, parse_prefill), (DecodeConfig, parse_decode),
    (AgentConfig, parse_agent),
]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / name).write_text("{}")
    return tmp_path


def test_every_flag_comes_from_a_field_and_reaches_it(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    flagged = {f.name: f.metadata["flag"] for f in fields(RouterConfig) if "flag" in f.metadata}
    assert {"model_dir", "grpc_port", "http_port", "admission", "generation_config"} <= set(flagged)
    for spec in flagged.values():
        monkeypatch.delenv(env_name(spec.name), raising=False)
    monkeypatch.setenv(env_name("--generation-config"), "none")
    monkeypatch.setenv(env_name("--max-batch-tokens"), "123")
    config = parse_args(["--model", str(model_dir), "--prefill-address", "a:1,b:2", "--decode-address", "c:3",
                         "--admission", "off", "--http-port", "0"])
    assert config.model_dir == model_dir and config.prefill_addresses == ("a:1", "b:2")
    assert config.admission is False and config.http_port == 0
    assert config.generation_config == "none" and config.max_batch_tokens == 123  # from TANDEM_* twins
    assert config.router_id.startswith("router-")  # made up when not given
    monkeypatch.delenv(env_name("--generation-config"))
    monkeypatch.delenv(env_name("--max-batch-tokens"))
    defaults = parse_args(["--model", str(model_dir), "--prefill-address", "a:1", "--decode-address", "c:3"])
    for name, spec in flagged.items():
        if name not in ("model_dir", "prefill_addresses", "decode_addresses", "router_id", "admission", "redis_url"):
            assert getattr(defaults, name) == spec.parse(spec.default), name


def test_the_admission_margin_reaches_the_controller_and_is_bounded(smollm2_dir: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``--admission-margin`` (and its TANDEM_* twin) is the margin the router's admission refuses
    with; outside [0, the cold start's margin] it is a clear error, not a controller that raises later."""
    from router.server import _admission_controller
    from tandem.engine.config import ModelConfig
    monkeypatch.delenv(env_name("--admission-margin"), raising=False)
    base = ["--model", str(smollm2_dir), "--prefill-address", "a:1", "--decode-address", "c:3"]
    model_config = ModelConfig.from_dir(smollm2_dir)
    assert _admission_controller(parse_args(base), model_config, "", "m").margin == 0.25  # the default
    for margin in (0.0, 0.1, 0.5, 1.0):
        config = parse_args([*base, "--admission-margin", str(margin)])
        assert config.admission_margin == margin
        assert _admission_controller(config, model_config, "", "m").margin == margin
    monkeypatch.setenv(env_name("--admission-margin"), "0.15")
    assert parse_args(base).admission_margin == 0.15
    for bad in ("-0.1", "1.5"):
        with pytest.raises(ValueError, match="--admission-margin"):
            parse_args([*base, "--admission-margin", bad])


def test_the_admission_log_opens_one_file_per_model(smollm2_dir: Path, tmp_path: Path) -> None:
    """``--admission-log FILE``: the router's admission appends its decisions there as JSON lines; in
    a router of several models each model's go to FILE with its served name added."""
    import json

    from router.server import _admission_controller
    from tandem.engine.config import ModelConfig
    base = ["--model", str(smollm2_dir), "--prefill-address", "a:1", "--decode-address", "c:3"]
    model_config = ModelConfig.from_dir(smollm2_dir)
    assert _admission_controller(parse_args(base), model_config, "", "m").decision_log is None
    path = tmp_path / "decisions.jsonl"
    config = parse_args([*base, "--admission-log", str(path)])
    for model, served, file in (("", "m", path), ("big", "big", tmp_path / "decisions.big.jsonl")):
        controller = _admission_controller(config, model_config, model, served)
        assert controller.try_admit("r1", 12, now_s=1.0) is None
        controller.close_log()
        line = json.loads(file.read_text().splitlines()[-1])
        assert line["event"] == "admitted" and line["request_id"] == "r1" and line["model"] == model


@pytest.mark.parametrize("config_type, parse", PARSERS, ids=lambda x: getattr(x, "__name__", ""))
def test_help_lists_every_flag_with_its_env_twin(config_type: type, parse: Callable[[Sequence[str]], Any],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    specs = flag_specs(config_type)
    assert len(specs) == len(fields(config_type)) or config_type is RouterConfig  # every service field is a flag
    for name, spec in specs:
        assert spec.name in text and env_name(spec.name) in text, name


def _clear_env(monkeypatch: pytest.MonkeyPatch, config_type: type) -> None:
    for _, spec in flag_specs(config_type):
        monkeypatch.delenv(env_name(spec.name), raising=False)
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("TANDEM_ADMISSION", raising=False)


def test_prefill_flags_and_twins_reach_their_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_env(monkeypatch, PrefillConfig)
    monkeypatch.setenv("REDIS_URL", "redis://r:1")
    monkeypatch.setenv(env_name("--layer-group-size"), "3")
    config = parse_prefill(["--port", "7", "--ttft-slo-ms", "900", "--drop-late", "on"])
    assert (config.port, config.ttft_slo_ms, config.drop_late) == (7, 900.0, True)
    assert config.layer_group_size == 3 and config.redis_url == "redis://r:1"
    assert config.service_id.startswith("prefill-") and config.max_batch_tokens == 4096
    monkeypatch.setenv("TANDEM_ADMISSION", "on")
    assert parse_prefill([]).drop_late is True  # admission on: late prompts are dropped by default
    assert parse_prefill(["--drop-late", "off", "--service-id", "p1"]).drop_late is False
    monkeypatch.delenv("REDIS_URL")
    with pytest.raises(ValueError, match="--decode-address"):
        parse_prefill([])


def test_decode_flags_and_twins_reach_their_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_env(monkeypatch, DecodeConfig)
    monkeypatch.setenv(env_name("--max-batch-requests"), "12")
    config = parse_decode(["--redis-url", "redis://r:1", "--quantization", "fp32", "--service-id", "d1"])
    assert (config.max_batch_requests, config.quantization, config.service_id) == (12, "fp32", "d1")
    assert config.resume is True and config.port == 50062
    assert parse_decode([]).resume is False  # nothing to resume from without Redis
    with pytest.raises(ValueError):
        parse_decode(["--quantization", "int3"])


def test_agent_flags_and_twins_reach_their_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_env(monkeypatch, AgentConfig)
    monkeypatch.setenv(env_name("--tbt-slo-ms"), "50")
    config = parse_agent(["--prefill-cores", "0-2", "--decode-cores", "3", "--num-blocks", "64",
                          "--policy", "chunked", "--kv-dtype", "float16"])
    assert config.prefill_cores == (0, 1, 2) and config.decode_cores == (3,)
    assert (config.num_blocks, config.policy, config.kv_dtype, config.tbt_slo_ms) == (64, "chunked", "float16", 50.0)
    assert config.instance_id.isalnum() and config.quantization == "auto" and config.models == (ModelSpec("default"),)
    defaults = parse_agent([])
    assert defaults.prefill_cores and defaults.decode_cores  # split of this process's cores
    with pytest.raises(ValueError, match="--policy"):
        parse_agent(["--policy", "fastest"])
    assert defaults.chunk_tbt_target == 0.8 and parse_agent(["--chunk-tbt-target", "0.75"]).chunk_tbt_target == 0.75
    assert defaults.chunk_floor_tbt_target == 0.8
    assert parse_agent(["--chunk-floor-tbt-target", "1"]).chunk_floor_tbt_target == 1.0
    for bad in ("0", "1.2"):
        with pytest.raises(ValueError, match="--chunk-tbt-target"):
            parse_agent(["--chunk-tbt-target", bad])
        with pytest.raises(ValueError, match="--chunk-floor-tbt-target"):
            parse_agent(["--chunk-floor-tbt-target", bad])
        with pytest.raises(ValueError, match="--chunk-spent-tbt-target"):
            parse_agent(["--chunk-spent-tbt-target", bad])
    assert defaults.chunk_spent_tbt_target == 0.65
    assert parse_agent(["--chunk-spent-tbt-target", "1"]).chunk_spent_tbt_target == 1.0
    assert defaults.chunk_floor_within_slo and not parse_agent(["--chunk-floor-within-slo", "false"]).chunk_floor_within_slo
    monkeypatch.setenv(env_name("--split-rate-check"), "on")
    assert not defaults.split_rate_check and parse_agent([]).split_rate_check
