"""The router's config declares each flag once, on its field: flag, TANDEM_* twin, default, help."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from router.config import RouterConfig, parse_args
from tandem.service.flags import env_name


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
            assert getattr(defaults, name) == spec.default, name


def test_help_lists_every_flag_with_its_env_twin(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for f in fields(RouterConfig):
        if "flag" in f.metadata:
            assert f.metadata["flag"].name in text and env_name(f.metadata["flag"].name) in text, f.name
