"""Bad model input gives a clear error that names the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem.engine.config import ModelConfig
from tandem.engine.errors import InvalidRequestError, ModelLoadError
from tandem.engine.kv_pool import KVPool, KVPoolSpec
from tandem.engine.runner import ModelRunner, SeqInput
from tandem.engine.weights import load_checkpoint

BASE = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 16,
}


def _write(tmp_path: Path, **changes: object) -> Path:
    cfg = dict(BASE)
    cfg.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_unknown_architecture_is_named(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="unsupported architecture 'GPT2LMHeadModel'"):
        ModelConfig.from_dir(_write(tmp_path, architectures=["GPT2LMHeadModel"]))


def test_missing_config_is_named(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        ModelConfig.from_dir(tmp_path)


def test_missing_field_is_named(tmp_path: Path) -> None:
    cfg = _write(tmp_path)
    raw = json.loads((cfg / "config.json").read_text())
    del raw["hidden_size"]
    (cfg / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="'hidden_size'"):
        ModelConfig.from_dir(cfg)


def test_missing_weights_are_named(tmp_path: Path) -> None:
    config = ModelConfig.from_dir(_write(tmp_path))
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors"):
        load_checkpoint(tmp_path, config, torch.float32)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    config = ModelConfig.from_dir(_write(tmp_path))
    save_file({"model.embed_tokens.weight": torch.zeros(32, 16)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.norm.weight"):
        load_checkpoint(tmp_path, config, torch.float32)


def test_wrong_shape_is_named(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    config = ModelConfig.from_dir(_write(tmp_path))
    save_file({"model.embed_tokens.weight": torch.zeros(31, 16)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model.embed_tokens.weight.*\(31, 16\)"):
        load_checkpoint(tmp_path, config, torch.float32)


def test_unsupported_rope_scaling_is_named(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="'yarn'"):
        ModelConfig.from_dir(_write(tmp_path, rope_scaling={"rope_type": "yarn", "factor": 2.0}))


def _random_runner(tmp_path: Path) -> ModelRunner:
    from tests.tiny_models import write_tiny_model

    model_dir = write_tiny_model(tmp_path, "llama", max_position_embeddings=16)
    config = ModelConfig.from_dir(model_dir)
    return ModelRunner.from_dir(model_dir, KVPool.create(KVPoolSpec.for_model(config, 8, 4)))


def test_prompt_longer_than_context_is_refused(tmp_path: Path) -> None:
    runner = _random_runner(tmp_path)
    with pytest.raises(InvalidRequestError, match="exceeds the model's context length of 16"):
        runner.forward([SeqInput(list(range(17)), 0, list(range(5)))])


def test_token_out_of_vocab_and_short_block_table_are_refused(tmp_path: Path) -> None:
    runner = _random_runner(tmp_path)
    with pytest.raises(InvalidRequestError, match="token id out of range"):
        runner.forward([SeqInput([1, 999], 0, [0])])
    with pytest.raises(InvalidRequestError, match="1 blocks cannot hold 6 tokens"):
        runner.forward([SeqInput([1, 2, 3, 4, 5, 6], 0, [0])])
